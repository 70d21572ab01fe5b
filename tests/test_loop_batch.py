"""Batch maths of the loop: loss normalisation over the global batch, a whole run against a plain torch loop,
run length, checkpoint and eval cadence.

The normalisation test compares the loop's real `train_step` (1 process with 4 micro-batches, 2 ranks
with 2 and 1 micro-batches, DDP's averaging done by hand) with an obviously-correct reference: one
forward over the whole global batch, mean over every unmasked target token. The loss masks make the
micro-batches uneven, which is where a mean of per-micro-batch means goes wrong (that gives gradients
off by tens of percent here; the tolerance below only absorbs the model's fp32 cross-entropy).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainbox.config import load_config
from trainbox.data.loader import BatchOrder, TokenDataset
from trainbox.errors import ConfigError
from trainbox.model.build import build_model
from trainbox.model.spec import family
from trainbox.objective import build_objective
from trainbox.parallel.ddp import DataParallel
from trainbox.parallel.distributed import Dist
from trainbox.train.loop import Trainer, plan_length, train

SEQ, VOCAB, GLOBAL = 16, 64, 8


def _model():
    cfg = load_config(None, ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.vocab_size=64"])
    torch.manual_seed(0)
    return build_model(cfg.model, VOCAB, SEQ).double(), cfg


def _masked_dataset() -> TokenDataset:
    rng = np.random.default_rng(3)
    toks = rng.integers(0, VOCAB, size=GLOBAL * 2 * SEQ + 1).astype(np.uint16)
    mask = rng.random(len(toks)) < 0.5
    mask[: 3 * SEQ] = False        # samples 0-2 carry almost no loss: very uneven micro-batches
    mask[3 * SEQ: 4 * SEQ] = True
    return TokenDataset([toks], SEQ, masks=[mask])


def _step_update(ds, world, rank, micro, model_state, step=1) -> tuple[dict[str, torch.Tensor], float, Trainer]:
    """Run the loop's real train_step on one rank with SGD(lr=1): returns -gradient per parameter."""
    model, cfg = _model()
    model.load_state_dict(model_state)
    t = Trainer.__new__(Trainer)
    cfg.optim.grad_clip, cfg.optim.warmup_steps, cfg.optim.schedule = 0.0, 0, "constant"
    t.cfg, t.dist, t.device, t.pin = cfg, Dist(rank=rank, world=world), torch.device("cpu"), False
    t.model, t.forward, t.total, t.family, t._prefetched = model, model, 10, family(cfg.model.family), None
    t.parallel = DataParallel(model, Dist(), t.device)   # one process: the model as it is
    t.objective = build_objective(cfg)
    t.autocast = lambda: torch.autocast("cpu", enabled=False)
    t.batches = BatchOrder(ds, GLOBAL, micro, world, rank, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.param_groups[0]["initial_lr"] = 1.0
    t.optimizers = [opt]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, _, _ = t.train_step(step)
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, float(loss), t


def test_loss_normalised_over_global_batch_independent_of_world_and_accum():
    ds = _masked_dataset()
    model, _ = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # reference: one forward over the whole global batch, mean over its unmasked targets
    plan = BatchOrder(ds, GLOBAL, GLOBAL, 1, 0, seed=5)
    b = ds.batch(plan.global_indices(1))
    logits = model.lm_head(model.hidden(b["x"]))
    targets = b["y"].masked_fill(~b["loss_mask"], -100)
    ref_loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-100)
    ref_loss.backward()
    ref = {n: -p.grad for n, p in model.named_parameters()}
    assert plan.target_tokens(1) == int(b["loss_mask"].sum())

    one, loss1, _ = _step_update(ds, 1, 0, 2, state)              # 1 process, accumulation 4
    r0, l0, _ = _step_update(ds, 2, 0, 2, state)                  # 2 ranks, accumulation 2
    r1, l1, _ = _step_update(ds, 2, 1, 2, state)
    s0, m0, _ = _step_update(ds, 2, 0, 4, state)                  # 2 ranks, accumulation 1
    s1, m1, _ = _step_update(ds, 2, 1, 4, state)
    for name, g in ref.items():
        torch.testing.assert_close(one[name], g, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close((r0[name] + r1[name]) / 2, g, rtol=1e-4, atol=1e-7)   # DDP's average
        torch.testing.assert_close((s0[name] + s1[name]) / 2, g, rtol=1e-4, atol=1e-7)
    # the logged loss is the global mean: 1 process directly, 2 ranks as the sum of their shares
    assert loss1 == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    assert l0 + l1 == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    assert m0 + m1 == pytest.approx(float(ref_loss.detach()), rel=1e-6)


def test_each_step_gets_its_own_batches_prefetched_or_not():
    """The loop sends step s+1's micro-batches at the end of step s (one stacked copy per field): every step
    trains on exactly plan.micro_batches(step), the masks and their trained rows included, and a batch sent for
    another step (a resumed or stopped run) is never used; the last step sends nothing."""
    ds = _masked_dataset()
    t = _step_update(ds, 1, 0, 2, _model()[0].state_dict(), step=3)[2]
    plan = t.batches

    def same(got, step):
        want = plan.micro_batches(step)
        assert len(got) == len(want) == plan.accum
        for g, w in zip(got, want):
            assert w.keys() == {"x", "y", "loss_mask"} and g.keys() == {*w, "rows"}
            assert all(torch.equal(g[k], w[k]) for k in w)
            rows, total = g["rows"]   # the trained targets' flat indices, found on the host (fused_ce.trained_rows)
            assert total == w["y"].numel()
            assert torch.equal(rows, (w["loss_mask"] & (w["y"] != -100)).reshape(-1).nonzero().squeeze(1))

    assert t._prefetched[0] == 4
    same(t._prefetched[1], 4)
    same(t._device_batches(6), 6)         # not the batches sent for step 4
    assert t._prefetched is None
    t._prefetched = (4, t._send_batches(4))
    same(t._device_batches(4), 4)
    t.train_step(t.total - 1)
    assert t._prefetched is None


def test_plan_length_from_steps_tokens_or_epochs():
    ds = TokenDataset([np.zeros(100 * SEQ + 1, dtype=np.uint16)], SEQ)   # 100 samples
    plan = BatchOrder(ds, 8, 4)
    assert plan.steps_per_epoch == 12
    mk = lambda *o: load_config(None, ["train.global_batch_size=8", f"data.seq_len={SEQ}", "train.max_steps=null", *o])  # noqa: E731
    assert plan_length(mk(), plan) == 12                                  # default: one epoch
    assert plan_length(mk("train.epochs=2.5"), plan) == 30
    assert plan_length(mk("train.max_tokens=1300"), plan) == 1300 // (8 * SEQ)
    with pytest.raises(ConfigError, match="each set the run's length"):   # one length setting, not a precedence
        mk("train.max_steps=7", "train.epochs=3")
    assert plan_length(load_config("tiny", ["train.epochs=3"]), plan) == 36   # it replaces the recipe's max_steps


def test_epoch_checkpoints_and_fixed_eval_slice(tmp_path, tiny):
    rng = np.random.default_rng(0)
    train_bin, val_bin = tmp_path / "train.bin", tmp_path / "val.bin"
    rng.integers(0, 500, size=31 * 32 + 1).astype(np.uint16).tofile(train_bin)   # 31 samples: 3 steps/epoch
    rng.integers(0, 500, size=4000).astype(np.uint16).tofile(val_bin)
    cfg = load_config(None, [*tiny, f"data.path={train_bin}", f"data.val_path={val_bin}", "train.epochs=2",
                             "train.max_steps=null", "train.checkpoint_every=4", "train.eval_every=2",
                             "train.keep_last=10", "train.eval_tokens=640", "monitor.enabled=false",
                             "train.sample_tokens=0"])
    result = train(cfg)
    assert result["step"] == 6
    ckpts = sorted(p.name for p in (cfg.run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000003", "step_00000004", "step_00000006"]   # epoch ends 3, 6 and every 4
    events = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4, 6]
    assert {e["val_tokens"] for e in evals} == {640}        # the same fixed slice every time
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_unused_data_is_counted_and_said():
    """File tails shorter than a window and the samples past the last full global batch of an epoch are
    reported (nothing is dropped without a word); exact data reports nothing."""
    from trainbox.data.loader import unused_data

    files = [np.zeros(n, dtype=np.uint16) for n in (100, 37, 5)]   # 6, 2 and 0 windows of 16 (+1 target)
    ds = TokenDataset(files, 16, name="train")
    tails, skipped, msg = unused_data(ds, global_batch=3)
    assert (tails, skipped) == ((100 - 97) + (37 - 33) + 5, 8 % 3)
    assert msg == ("train: not trained on: 12 tokens (8.5%) at the ends of 3 file(s) do not fill a window of 16 "
                   "tokens; 2 of 8 samples per epoch fall beyond the last full global batch of 3 "
                   "(a different 2 each epoch)")
    assert unused_data(TokenDataset([np.zeros(4 * 16 + 1, dtype=np.uint16)], 16), global_batch=2) == (0, 0, None)


def test_run_records_unused_data_in_its_start_event(tiny):
    cfg = load_config(None, [*tiny, "run.name=unused", "train.max_steps=1", "monitor.enabled=false",
                             "train.eval_every=0", "train.sample_tokens=0"])
    t = Trainer(cfg)
    t.run()
    start = next(json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "start")
    seq = cfg.data.seq_len
    expected = sum(len(a) - (((len(a) - 1) // seq) * seq + 1) for a in t.train_data.arrays)
    assert start["unused_tail_tokens"] == expected > 0
    assert start["unused_samples_per_epoch"] == t.train_data.num_samples % cfg.train.global_batch_size


def test_training_matches_a_plain_torch_loop(tiny):
    """The loop's whole step over a run against a loop written the way nanoGPT's train.py writes it, with
    torch's own pieces: torch.optim.AdamW with nanoGPT's two groups (decay on matrices only), torch's LinearLR
    then CosineAnnealingLR for the warm-up and the cosine decay to min_lr_ratio, clip_grad_norm_, and the mean
    cross-entropy of each micro-batch divided by the accumulation. Same initial weights, same batches, fp32:
    every step's loss, lr and gradient norm, and the final weights must agree. A warm-up off by one step, a
    cosine of the wrong length, weight decay on the norms, another clip threshold or Adam eps, or a loss
    scaled 1% off each fails it."""
    steps, warmup, lr0, lo, wd, clip = 9, 3, 3e-3, 0.1, 0.1, 0.3
    cfg = load_config(None, [*tiny, "run.name=plain", f"train.max_steps={steps}", f"optim.warmup_steps={warmup}",
                             f"optim.lr={lr0}", f"optim.min_lr_ratio={lo}", "optim.schedule=cosine",
                             f"optim.weight_decay={wd}", f"optim.grad_clip={clip}", "train.compile=false",
                             "train.eval_every=0", "train.checkpoint_every=0", "train.sample_tokens=0",
                             "monitor.enabled=false", "model.dropout=0.0"])
    t = Trainer(cfg)
    t.run()
    events = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {e["step"]: e for e in events if e["event"] == "train"}

    torch.manual_seed(cfg.run.seed)   # the loop's initial weights (a different draw fails the first loss)
    ref = build_model(cfg.model, t.vocab, cfg.data.seq_len, run=cfg)
    params = list(ref.parameters())
    opt = torch.optim.AdamW([dict(params=[p for p in params if p.dim() >= 2], weight_decay=wd),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
                            lr=lr0, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 1 / (warmup + 1), warmup / (warmup + 1), total_iters=warmup - 1),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - warmup, eta_min=lo * lr0)],
        milestones=[warmup])
    clipped = 0
    for step in range(steps):
        lr = opt.param_groups[0]["lr"]
        batches = t.batches.micro_batches(step)
        loss_sum = 0.0
        for b in batches:
            logits = ref.lm_head(ref.hidden(b["x"]))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), b["y"].reshape(-1)) / len(batches)
            loss.backward()
            loss_sum += loss.item()
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        clipped += norm > clip
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        got = logged[step + 1]
        assert got["loss"] == pytest.approx(loss_sum, rel=1e-5), step
        assert got["lr"] == pytest.approx(lr, rel=1e-9), step
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-4), step
    assert clipped >= 3     # the clip really acted (on the first steps at least)
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(t.model.state_dict()[name], p, rtol=1e-4, atol=1e-6, msg=name)


def test_lr_schedule_is_nanogpts_get_lr():
    """optim.warmup_steps = nanoGPT's warmup_iters gives nanoGPT's lr at every step of a run of lr_decay_iters
    steps (its train.py get_lr, written out here), for the 200-step comparison and for the recipe's own run.
    The ramp (s + 1) / W, 5% hotter over 20 steps, fails it."""
    import math

    from trainbox.config import OptimSection
    from trainbox.optim.build import lr_multiplier

    def get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):   # nanoGPT's train.py
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (learning_rate - min_lr)

    for warmup, total in ((20, 200), (700, 19073), (1, 5)):
        cfg = OptimSection(lr=6e-4, min_lr_ratio=0.1, warmup_steps=warmup, schedule="cosine")
        for step in range(total):
            assert cfg.lr * lr_multiplier(step, total, cfg) == pytest.approx(
                get_lr(step, 6e-4, 6e-5, warmup, total), rel=1e-12), (warmup, total, step)
