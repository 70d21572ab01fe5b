"""Exact resume on one process (in-process runs; the 2-process and cross-world cases are in
test_distributed.py): 0->20 straight against 0->10, stop, resume ->20, bit for bit; the resumed
process's meters count only its own steps; init_from loads weights only."""
from __future__ import annotations

import io
import json
import logging
import signal

import pytest
import torch

from trainbox import checkpoint
from trainbox.config import load_config
from trainbox.errors import CheckpointError, ConfigError
from trainbox.model.build import build_model
from trainbox.monitor.console import ProgressBar
from trainbox.train.loop import Trainer, train


def _cfg(tiny, *extra):
    return load_config(None, [*tiny, "monitor.enabled=false", "train.sample_tokens=0", "train.eval_every=0",
                              "train.max_steps=20", *extra])


def _train_losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["event"] == "train"]


class StopAfter(Trainer):
    """A Trainer whose stop flag is raised after step `n`, exactly as the SIGTERM handler raises it
    (real signals against real torchrun jobs are in test_distributed.py)."""

    def __init__(self, cfg, n: int, **kw):
        super().__init__(cfg, **kw)
        self.n = n

    def train_step(self, step: int):
        out = super().train_step(step)
        if step + 1 == self.n:
            self.stop.signum = signal.SIGTERM
        return out


# 256-token rows and window: the window really grows (from 128) over the run (window_warmup_steps null)
SPEEDRUN = ["model.family=speedrun", "model.head_dim=16", "optim.name=muon", "data.seq_len=256", "model.window=256",
            "model.window_warmup_steps=null", "model.window_pattern=LS", "train.micro_batch_size=2"]


def test_speedrun_recipe_resumes_bit_identically(tiny):
    """The speedrun family (Muon momentum and its warm-up, the window warm-up, long-short windows): a run
    cut at step 10 and resumed equals the straight run bit for bit."""
    straight = _cfg(tiny, *SPEEDRUN, "run.name=straight")
    train(straight)
    cut = _cfg(tiny, *SPEEDRUN, "run.name=cut")
    assert StopAfter(cut, 10).run()["step"] == 10
    Trainer(cut).run()
    assert _train_losses(cut.run_dir) == _train_losses(straight.run_dir)
    assert [s for s, _ in _train_losses(cut.run_dir)] == list(range(1, 21))


def test_speedrun_window_warms_up_over_the_run_when_null(tiny, monkeypatch):
    """model.window_warmup_steps=null: the loop hands the model its total, so over 20 steps the window grows
    from 128 to 128 + (256 - 128) * 19 / 20 = 249; the closing evaluation uses the full 256."""
    from trainbox.model.speedrun.model import SpeedrunGPT

    windows = []
    set_step = SpeedrunGPT.set_step

    def spy(self, step, total=None):
        set_step(self, step, total)
        windows.append(int(self.window))

    monkeypatch.setattr(SpeedrunGPT, "set_step", spy)
    Trainer(_cfg(tiny, *SPEEDRUN, "run.name=w")).run()
    assert windows[:20] == [128 + (256 - 128) * s // 20 for s in range(20)] and windows[19] == 249
    assert windows[20:] == [256]


def test_resume_is_bit_identical_and_meters_count_this_process(tiny):
    straight = _cfg(tiny, "run.name=straight")
    train(straight)
    cut = _cfg(tiny, "run.name=cut")
    first = StopAfter(cut, 10).run()
    assert first["stopped"] and first["step"] == 10
    assert [p.name for p in checkpoint.list_complete(cut.run_dir / "checkpoints")] == ["step_00000010"]

    bar = io.StringIO()
    second = Trainer(cut, progress=ProgressBar(stream=bar, enabled=True)).run()
    assert second["step"] == 20 and not second["stopped"]
    # every step exactly once, and each loss bit-identical to the uninterrupted run
    assert _train_losses(cut.run_dir) == _train_losses(straight.run_dir)
    assert [s for s, _ in _train_losses(cut.run_dir)] == list(range(1, 21))

    status = json.loads((cut.run_dir / "status.json").read_text())
    tokens_per_step = cut.train.global_batch_size * cut.data.seq_len
    assert status["steps_this_process"] == 10 and status["tokens_this_process"] == 10 * tokens_per_step
    assert status["tokens_seen"] == 20 * tokens_per_step and status["restarts"] == 1
    assert status["resumed_from"].endswith("step_00000010")
    assert bar.getvalue().split("\r")[1].split("] ")[1].startswith("10/20 ")   # first redraw: resumed step
    # tokens/s of the resumed process: its first logged window starts at its own first step, so the
    # rate can never include the first process's 10 steps (that would double it or more)
    rows = [json.loads(line) for line in (cut.run_dir / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in rows if r["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 10]
    resumed_rates = [r["tokens_per_s"] for r in rows if r["event"] == "train" and r["step"] == 11]
    assert resumed_rates == [None]   # no rate before this process has a timed step


def test_init_from_loads_weights_only(tiny, tmp_path, caplog):
    tmp = tmp_path / "nothing-here"
    src = _cfg(tiny, "run.name=src", "train.max_steps=6")
    train(src)
    ckpt = checkpoint.latest(src.run_dir / "checkpoints")
    new = _cfg(tiny, "run.name=fresh", "train.max_steps=2", f"run.init_from={ckpt}")
    t = Trainer(new)
    with caplog.at_level(logging.INFO, logger="trainbox"):
        t.run()
    assert f"starting from the weights of {ckpt} (run.init_from={ckpt})" in caplog.messages
    # a new run: starts at step 0 with a fresh optimizer (AdamW's step count restarts)
    assert [s for s, _ in _train_losses(new.run_dir)] == [1, 2]
    opt_state = torch.load(checkpoint.latest(new.run_dir / "checkpoints") / "optimizer.pt", weights_only=False)
    assert {float(s["step"]) for s in opt_state[0]["state"].values()} == {2.0}
    # its first loss is the loss of the source weights on global batch 0
    model = build_model(new.model, t.model.lm_head.weight.shape[0], new.data.seq_len)
    checkpoint.load_weights(ckpt, model)
    with torch.no_grad():
        parts = [model(b["x"], b["y"]).loss for b in t.batches.micro_batches(0)]
    expected = float(torch.stack(parts).mean())
    assert abs(_train_losses(new.run_dir)[0][1] - expected) < 1e-5
    scratch = _cfg(tiny, "run.name=scratch", "train.max_steps=1")
    train(scratch)
    assert abs(_train_losses(scratch.run_dir)[0][1] - expected) > 0.1   # not the random initialisation
    # what it cannot load is named as run.init_from, with a hint for a new run (not a resume's)
    with pytest.raises(CheckpointError) as e:
        train(_cfg(tiny, "run.name=none", "train.max_steps=1", f"run.init_from={tmp}"))
    assert e.value.message == f"run.init_from={tmp}: no complete checkpoint found at {tmp}"
    assert "Hugging Face model folder" in e.value.hint
    wider = _cfg(tiny, "run.name=wider", "train.max_steps=1", "model.n_embd=64", f"run.init_from={ckpt}")
    with pytest.raises(CheckpointError) as e:
        train(wider)
    assert e.value.message.startswith(f"run.init_from={ckpt}: checkpoint {ckpt} holds a differently shaped model (")
    assert e.value.message.endswith(" vs (192,))")   # c_attn's bias, 3 x 64; no resume's "changed since it was saved"
    assert e.value.hint.startswith("run.init_from loads a model of this run's shape") and "resume" not in e.value.hint


def test_init_from_on_a_run_with_checkpoints_is_refused_unless_the_run_started_from_it(tiny, tmp_path, caplog,
                                                                                       monkeypatch):
    """run.init_from starts a new run from weights: on a run folder with checkpoints, where the start would resume
    and drop it, it is refused in one message; the run's own run.init_from (the command that started it, again)
    resumes, and run.resume=never starts the run over from those weights."""
    donor = _cfg(tiny, "run.name=donor", "train.max_steps=4")
    train(donor)
    own = _cfg(tiny, "run.name=p1", "train.max_steps=2")
    train(own)
    for init_from in (donor.run_dir, own.run_dir.parent / "p1-other"):
        with pytest.raises(ConfigError) as e:
            train(_cfg(tiny, "run.name=p1", "train.max_steps=3", f"run.init_from={init_from}"))
        assert e.value.message == (f"run.init_from={init_from} starts a new run from those weights, but run "
                                   f"{own.run_dir} has checkpoints (it was not started from run.init_from) and would "
                                   f"resume from {own.run_dir / 'checkpoints' / 'step_00000002'}")
        assert e.value.hint == ("start a new run from those weights with run.name=NEW_NAME, or start this one over "
                                "from them with run.resume=never (its files move to superseded/)")
    assert [s for s, _ in _train_losses(own.run_dir)] == [1, 2] and not (own.run_dir / "superseded").exists()
    # a run started from run.init_from: the same command resumes it (relative or absolute, the same path), after a
    # resume without run.init_from too (trainer.json carries it); another run.init_from is refused naming it
    started = _cfg(tiny, "run.name=p2", "train.max_steps=2", f"run.init_from={donor.run_dir}")
    assert StopAfter(started, 1).run()["step"] == 1
    train(_cfg(tiny, "run.name=p2", "train.max_steps=2"))
    trainer = json.loads((started.run_dir / "checkpoints" / "step_00000002" / "trainer.json").read_text())
    assert trainer["init_from"] == str(donor.run_dir) and trainer["config"]["run"]["init_from"] is None
    caplog.clear()
    monkeypatch.chdir(tmp_path)
    again = _cfg(tiny, "run.name=p2", "train.max_steps=3", f"run.init_from={donor.run_dir.relative_to(tmp_path)}")
    with caplog.at_level(logging.INFO, logger="trainbox"):
        assert train(again)["step"] == 3
    assert f"resuming from {started.run_dir / 'checkpoints' / 'step_00000002'} at step 2" in caplog.messages
    assert not [m for m in caplog.messages if m.startswith("starting from the weights")]
    with pytest.raises(ConfigError) as e:
        train(_cfg(tiny, "run.name=p2", "train.max_steps=4", f"run.init_from={own.run_dir}"))
    assert f"(it was started from run.init_from={donor.run_dir})" in e.value.message
    # run.resume=never: a new start in the folder, from the donor's newest checkpoint
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainbox"):
        train(_cfg(tiny, "run.name=p1", "train.max_steps=1", "run.resume=never", f"run.init_from={donor.run_dir}"))
    assert (f"starting from the weights of {donor.run_dir / 'checkpoints' / 'step_00000004'} "
            f"(run.init_from={donor.run_dir})") in caplog.messages
    assert [s for s, _ in _train_losses(own.run_dir)] == [1]


def test_a_resume_with_settings_that_change_no_maths_follows_the_uninterrupted_run(tiny):
    """train.gc_every and data.download change no step's maths: a resume with them changed passes silently (no
    `changed` in its start event) and its losses equal the uninterrupted run's bit for bit. train.cuda_graphs
    (which a CPU run cannot switch on) passes the same comparison: a checkpoint of a run on one GPU, where auto is
    on, resumes on another layout, where it is off."""
    from trainbox.train.resume import compare

    straight = _cfg(tiny, "run.name=straight", "train.max_steps=8")
    train(straight)
    cut = _cfg(tiny, "run.name=cut", "train.max_steps=8")
    assert StopAfter(cut, 4).run()["step"] == 4
    changed = _cfg(tiny, "run.name=cut", "train.max_steps=8", "train.gc_every=1", "data.download=false")
    assert Trainer(changed).run()["step"] == 8
    assert _train_losses(cut.run_dir) == _train_losses(straight.run_dir)
    rows = [json.loads(line) for line in (cut.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [("changed" in r) for r in rows if r["event"] == "start"] == [False, False]
    saved = json.loads((cut.run_dir / "checkpoints" / "step_00000004" / "trainer.json").read_text())["config"]
    assert (saved["train"]["gc_every"], saved["data"]["download"]) == (50, True)
    saved["train"].update(cuda_graphs=True, compile=True)
    assert compare(saved, changed) == ({}, {})


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_checkpoint_file_gets_the_mode_of_a_new_file(tmp_path, umask):
    """safetensors writes its file 0600: a checkpoint's files all get what a new file gets under the umask, so
    whoever may read the run (the host's user, for a container's run) reads the weights too."""
    import os
    old = os.umask(umask)
    try:
        ckpt = checkpoint.save(tmp_path, 1, {"w": torch.ones(2, 2)}, [{"state": {}}], {"step": 1}, [{}], keep_last=1)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in ckpt.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "trainer.json", "rng.pt", "COMPLETE"} <= set(modes)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def test_a_resume_on_training_data_changed_in_place_is_refused(tiny, tmp_path):
    """The same data.path with other contents (a text file cut to half its documents): the checkpoint records its
    training set's samples and tokens, and the resume is refused naming both and the way to train the new data
    from the checkpoint's weights; on the data it was trained on it continues."""
    from trainbox.errors import ConfigError
    text = tmp_path / "plays.txt"
    lines = [f"line {i}: to be or not to be, that is the question of the day number {i}\n" for i in range(400)]
    text.write_text("".join(lines))
    args = [f"data.path={text}", "train.checkpoint_every=5"]
    train(_cfg(tiny, *args, "train.max_steps=5"))
    saved = json.loads((checkpoint.latest(tmp_path / "runs" / "tiny" / "checkpoints") / "trainer.json").read_text())
    assert saved["data"]["samples"] > 0 and saved["data"]["tokens"] > 0
    text.write_text("".join(lines[:200]))
    with pytest.raises(ConfigError, match=r"is not the training data .*step_00000005 was trained on \(samples "
                                          r"\d+ then, \d+ now; tokens [\d,]+ then, [\d,]+ now\)") as e:
        train(_cfg(tiny, *args, "train.max_steps=10"))
    assert "run.init_from=" in e.value.hint
    text.write_text("".join(lines))
    assert train(_cfg(tiny, *args, "train.max_steps=10"))["step"] == 10
