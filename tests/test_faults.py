"""Faults: SIGKILL at random points of a checkpoint save, a real NaN, a failed (file-too-large) save,
keep-last-K around the checkpoint being resumed from."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import resource
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from trainbox import checkpoint
from trainbox.config import load_config
from trainbox.errors import CheckpointError, TrainingFailed
from trainbox.train.loop import Trainer, train


def _cfg(tiny, *extra):
    return load_config(None, [*tiny, "monitor.enabled=false", "train.sample_tokens=0", "train.eval_every=0", *extra])


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(256, 1024, generator=g), "b": torch.full((300_000,), float(step))}


def _saver(root: str, first_step: int, conn) -> None:
    """Child process: save checkpoints first_step, first_step+1, ... forever, reporting each one done."""
    torch.set_num_threads(1)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    opt.step()
    step = first_step
    while True:
        t0 = time.perf_counter()
        checkpoint.save(Path(root), step, _weights(step), [opt], {"step": step}, [checkpoint.rng_state()], 2)
        conn.send((step, time.perf_counter() - t0))
        step += 1


from pathlib import Path  # noqa: E402  (used by the forked child above)


def _check_usable(root: Path, done_step: int) -> int:
    """The newest COMPLETE checkpoint loads in full, holds what was written for its step and is not
    older than the last save the child reported finished. Returns its step."""
    ckpt = checkpoint.latest(root)
    assert ckpt is not None
    step = checkpoint.load_trainer(ckpt)["step"]
    assert ckpt.name == f"step_{step:08d}" and step >= done_step
    w = load_file(str(ckpt / "model.safetensors"))
    ref = _weights(step)
    assert torch.equal(w["a"], ref["a"]) and torch.equal(w["b"], ref["b"])
    opt = torch.optim.AdamW(torch.nn.Linear(64, 64).parameters())
    checkpoint.load_optimizers(ckpt, [opt])
    assert checkpoint.load_rng(ckpt, 0)["torch"].numel() > 0
    pointer = (root / "latest").read_text().strip()   # may lag by one save, never names a broken one
    assert (root / pointer / "COMPLETE").is_file()
    return step


def test_sigkill_at_random_points_of_a_save_leaves_a_usable_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    ctx = mp.get_context("fork")
    rnd = random.Random(1234)
    next_step, done = 1, 0
    kills, mid_save = 0, 0
    for trial in range(14):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_saver, args=(str(root), next_step, child))
        proc.start()
        step, seconds = parent.recv()          # one save finished: the kill lands in a later one
        done = max(done, step)
        # a random moment within the next save (or two): covers tensors, fsync, COMPLETE, rename, prune
        deadline = time.perf_counter() + rnd.uniform(0, 2 * seconds)
        while time.perf_counter() < deadline:
            if parent.poll():
                done = max(done, parent.recv()[0])
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        while parent.poll():
            done = max(done, parent.recv()[0])
        kills += proc.exitcode == -signal.SIGKILL
        mid_save += any(p.name.startswith(".tmp-") for p in root.iterdir())
        next_step = _check_usable(root, done) + 1
    assert kills == 14 and mid_save >= 3, (kills, mid_save)   # most kills land inside a save
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
    # interrupted saves leave temp folders; the next successful save removes them
    train_step = next_step
    checkpoint.save(root, train_step, _weights(train_step), [torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())],
                    {"step": train_step}, [checkpoint.rng_state()], 2)
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp", ".del"))], leftovers
    assert len(checkpoint.list_complete(root)) == 2


class PoisonAt(Trainer):
    """Sets one weight to inf just before step `n` runs: the forward pass then produces a real NaN."""

    def __init__(self, cfg, n: int):
        super().__init__(cfg)
        self.n = n

    def _train_step(self, step: int):
        if step + 1 == self.n:
            with torch.no_grad():
                self.model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
        return super()._train_step(step)


def test_nan_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(tiny):
    cfg = _cfg(tiny, "run.name=nan", "train.max_steps=12", "train.checkpoint_every=3", "monitor.log_every=5")
    with pytest.raises(TrainingFailed, match=r"loss is nan at step 7\b") as err:
        PoisonAt(cfg, 7).run()
    root = cfg.run_dir / "checkpoints"
    assert [p.name for p in checkpoint.list_complete(root)] == ["step_00000003", "step_00000006"]
    assert "step_00000006" in str(err.value)
    w = load_file(str(root / "step_00000006" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values())
    status = json.loads((cfg.run_dir / "status.json").read_text())
    assert status["phase"] == "failed" and "step 7" in status["error"]


def test_failed_save_keeps_older_checkpoints(tiny):
    cfg = _cfg(tiny, "run.name=full", "train.max_steps=8", "train.checkpoint_every=2", "train.keep_last=2")
    first = _cfg(tiny, "run.name=full", "train.max_steps=8", "train.checkpoint_every=2", "train.keep_last=2")
    StopAfter4(first).run()
    root = cfg.run_dir / "checkpoints"
    assert [p.name for p in checkpoint.list_complete(root)] == ["step_00000002", "step_00000004"]
    # "disk full": files may not grow past 64 KiB (EFBIG) while the resumed run tries to save step 6
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(CheckpointError, match="step_00000006 failed.*older checkpoints are kept"):
            Trainer(cfg).run()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert [p.name for p in root.iterdir()] and not list(root.glob(".tmp-*"))
    assert [p.name for p in checkpoint.list_complete(root)] == ["step_00000002", "step_00000004"]
    assert (root / "latest").read_text().strip() == "step_00000004"
    checkpoint.load_weights(root / "step_00000004", _model_for(cfg))
    assert json.loads((cfg.run_dir / "status.json").read_text())["phase"] == "failed"


class StopAfter4(Trainer):
    def _train_step(self, step: int):
        out = super()._train_step(step)
        if step + 1 == 4:
            self.stop.signum = signal.SIGTERM
        return out


def _model_for(cfg):
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.model.registry import build_model, pad_vocab
    return build_model(cfg.model, pad_vocab(get_tokenizer(cfg.data.tokenizer).vocab_size), cfg.data.seq_len)


def test_keep_last_never_deletes_the_checkpoint_resumed_from(tiny):
    base = _cfg(tiny, "run.name=keep", "train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=3")
    train(base)
    root = base.run_dir / "checkpoints"
    again = _cfg(tiny, "run.name=keep", "train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=1",
                 f"run.resume={root / 'step_00000002'}")
    train(again)
    assert [p.name for p in checkpoint.list_complete(root)] == ["step_00000002", "step_00000006"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_out_of_memory_names_the_micro_batch_and_what_to_do(tiny):
    """A real CUDA OOM (a 512k-token micro-batch of 50,304-wide logits) ends in one TrainingFailed that says
    which setting to lower, not a raw allocator traceback."""
    cfg = _cfg(tiny, "run.name=oom", "data.tokenizer=gpt2", "data.seq_len=1024",
               "train.global_batch_size=512", "train.micro_batch_size=512", "train.max_steps=1",
               "train.device=cuda")
    with pytest.raises(TrainingFailed, match=r"out of memory in step 1 at train.micro_batch_size=512") as err:
        train(cfg)
    assert "lower train.micro_batch_size (e.g. 256)" in err.value.hint
    status = json.loads((cfg.run_dir / "status.json").read_text())
    assert status["phase"] == "failed" and "out of memory" in status["error"]
