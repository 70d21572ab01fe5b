"""Faults around checkpoints, in-process: SIGKILL at random points of a save, a real NaN, a failed (file too
large) save, keep-last-K around the checkpoint resumed from, every kind of damaged checkpoint (named, and the
one before it resumes; a step folder without COMPLETE among them), code-running pickles (never run), changed
settings on resume (applied and recorded, or refused), a new start in an old folder, run names and planted links
(nothing written outside the run). Real processes under signals and kills: test_faults_signals.py; saves that
do not fit (ulimit -f, a full disk): test_faults_disk.py; token files and prepare: test_faults_data.py."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import resource
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file

from trainbox import checkpoint
from trainbox.config import load_config
from trainbox.errors import CheckpointError, ConfigError, RunFinished, TrainingFailed
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
    for _trial in range(14):
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

    def train_step(self, step: int):
        if step + 1 == self.n:
            with torch.no_grad():
                self.model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
        return super().train_step(step)


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
    def train_step(self, step: int):
        out = super().train_step(step)
        if step + 1 == 4:
            self.stop.signum = signal.SIGTERM
        return out


def _model_for(cfg):
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.model.build import build_model, pad_vocab
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
               "train.device=cuda", "train.memory_check=false")   # the pre-flight check would refuse it
    with pytest.raises(TrainingFailed, match=r"out of memory in step 1 at train.micro_batch_size=512") as err:
        train(cfg)
    assert "lower train.micro_batch_size (e.g. 256)" in err.value.hint
    status = json.loads((cfg.run_dir / "status.json").read_text())
    assert status["phase"] == "failed" and "out of memory" in status["error"]


# ----------------------------------------------------------------------------- damaged checkpoints

def _flip(path: Path, offset_from_end: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])




DAMAGE = {   # kind -> (file named in the message, how)
    "weights truncated": ("model.safetensors", _truncate),
    "weights bit flipped": ("model.safetensors", _flip),
    "weights missing": ("model.safetensors", lambda p: p.unlink()),
    "optimizer garbage": ("optimizer.pt", lambda p: p.write_bytes(os.urandom(p.stat().st_size))),
    "optimizer bit flipped": ("optimizer.pt", _flip),
    "trainer.json broken": ("trainer.json", lambda p: p.write_text(p.read_text()[:-40])),
    "trainer.json edited": ("trainer.json", lambda p: p.write_text(p.read_text().replace('"step": 4', '"step": 3'))),
    "rng truncated": ("rng.pt", _truncate),
    "rng missing": ("rng.pt", lambda p: p.unlink()),
    "manifest not JSON": ("COMPLETE", lambda p: p.write_text("4\n")),
    "manifest deleted": ("COMPLETE", lambda p: p.unlink()),   # a step_X no save leaves: it renames after COMPLETE
    "manifest wrong size": ("model.safetensors",
                            lambda p: p.write_text(p.read_text().replace('"bytes": ', '"bytes": 1'))),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, data_cache):
    """A run of 4 steps with checkpoints at 2 and 4, and the straight 6-step run's losses."""
    from conftest import TINY
    root = tmp_path_factory.mktemp("damage")
    base = [*TINY, f"run.dir={root}", f"data.cache_dir={data_cache}", "monitor.enabled=false", "train.sample_tokens=0",
            "train.eval_every=0", "train.checkpoint_every=2"]
    train(load_config(None, [*base, "run.name=saved", "train.max_steps=4"]))
    train(load_config(None, [*base, "run.name=straight", "train.max_steps=6"]))
    return root, base, _losses(root / "straight")


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["event"] == "train"}


def _copy_run(saved_run, name: str) -> Path:
    import shutil
    root = saved_run[0]
    shutil.copytree(root / "saved", root / name)
    (root / name / ".lock").unlink(missing_ok=True)
    return root / name


@pytest.mark.faults
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_named_and_the_one_before_resumes(saved_run, kind, caplog):
    root, base, straight = saved_run
    name = "d-" + kind.replace(" ", "-").replace(".", "")
    run_dir = _copy_run(saved_run, name)
    culprit, damage = DAMAGE[kind]
    target = run_dir / "checkpoints" / "step_00000004"
    damage(target / ("COMPLETE" if kind.startswith("manifest wrong") else culprit))
    with caplog.at_level("INFO", logger="trainbox"):
        result = train(load_config(None, [*base, f"run.name={name}", "train.max_steps=6"]))
    assert result["step"] == 6
    warning = next(r.getMessage() for r in caplog.records if "does not verify" in r.getMessage())
    assert "step_00000004" in warning and culprit in warning, warning
    assert any("resuming from" in r.getMessage() and "step_00000002" in r.getMessage() for r in caplog.records)
    got = _losses(run_dir)
    assert all(got[s] == straight[s] for s in (3, 4, 5, 6)), "the resumed run differs from the straight run"
    moved = list((run_dir / "superseded").glob("*/checkpoints/step_00000004"))
    assert len(moved) == 1, "the damaged checkpoint is set aside, not deleted"
    for ckpt in checkpoint.list_complete(run_dir / "checkpoints"):
        checkpoint.verify(ckpt)


@pytest.mark.faults
def test_no_checkpoint_verifies_stops_with_a_clear_message(saved_run):
    root, base, _ = saved_run
    run_dir = _copy_run(saved_run, "none-verify")
    for step in (2, 4):
        _flip(run_dir / "checkpoints" / f"step_{step:08d}" / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints in .* verifies.*optimizer.pt") as err:
        train(load_config(None, [*base, "run.name=none-verify", "train.max_steps=6"]))
    assert "run.resume=never" in err.value.hint
    assert len(checkpoint.list_complete(run_dir / "checkpoints")) == 2, "nothing is deleted"


@pytest.mark.faults
def test_step_folders_without_complete_are_damage_not_a_new_start(saved_run):
    """A run whose checkpoints all lost COMPLETE stops naming the newest, as when none verifies: it does not start
    over silently; a step folder without COMPLETE given as run.resume is refused with the same reason."""
    root, base, _ = saved_run
    run_dir = _copy_run(saved_run, "no-marker")
    for step in (2, 4):
        (run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints in .* verifies; the newest: \S+step_00000004 "
                                              r"has no COMPLETE marker: its save was interrupted or the marker was "
                                              r"deleted"):
        train(load_config(None, [*base, "run.name=no-marker", "train.max_steps=6"]))
    assert not (run_dir / "superseded").exists(), "nothing is set aside"
    step_4 = run_dir / "checkpoints" / "step_00000004"
    with pytest.raises(CheckpointError, match=f"checkpoint {step_4} has {checkpoint.NO_MARKER}"):
        checkpoint.resolve(step_4)


class _Planted:
    """Unpickling this runs code: it creates the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.faults
@pytest.mark.parametrize("culprit", ["optimizer.pt", "rng.pt"])
def test_code_running_pickle_in_a_checkpoint_is_refused_and_never_runs(saved_run, culprit, tmp_path):
    root, base, _ = saved_run
    name = "pickle-" + culprit.split(".")[0]
    run_dir = _copy_run(saved_run, name)
    marker = tmp_path / "code-ran"
    ckpt = run_dir / "checkpoints" / "step_00000004"
    torch.save([_Planted(marker)], ckpt / culprit)
    checkpoint.write_manifest(ckpt, 4)   # the checksums agree: only safe loading stands between the file and the code
    with pytest.raises(CheckpointError, match=rf"{culprit} cannot be loaded safely"):
        train(load_config(None, [*base, f"run.name={name}", "train.max_steps=6"]))
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=rf"{culprit} cannot be loaded safely"):   # given as a path too
        train(load_config(None, [*base, "run.name=other-" + name, "train.max_steps=6", f"run.resume={ckpt}"]))
    assert not marker.exists()


@pytest.mark.faults
def test_code_running_pickle_as_init_from_weights_never_runs(saved_run, tmp_path):
    from trainbox.model.gpt.hf import read_hf_weights
    folder = tmp_path / "hf"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    torch.save({"w": _Planted(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin cannot be loaded safely"):
        read_hf_weights(folder)
    assert not marker.exists()


def test_checkpoint_loading_code_has_no_unsafe_torch_load():
    """No torch.load(weights_only=False), no pickle, in anything that reads run, checkpoint or downloaded files."""
    import re

    import trainbox
    src = Path(trainbox.__file__).parent
    assert (src / "checkpoint" / "__init__.py").is_file()
    offenders = [f"{p.relative_to(src)}:{i + 1}" for p in src.rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines())
                 if re.search(r"weights_only\s*=\s*False|pickle\.loads?\(|allow_pickle\s*=\s*True", line)]
    assert not offenders, offenders


# ----------------------------------------------------------------------------- changed settings on resume

@pytest.mark.faults
def test_changed_optimizer_settings_on_resume_apply_and_are_recorded(saved_run):
    root, base, straight = saved_run
    run_dir = _copy_run(saved_run, "new-lr")
    cfg = load_config(None, [*base, "run.name=new-lr", "train.max_steps=6", "optim.lr=0.001", "optim.betas=[0.8,0.9]"])
    t = Trainer(cfg)
    t.run()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = [r for r in rows if r["event"] == "start"][-1]
    assert start["changed"] == {"optim.betas": [[0.9, 0.95], [0.8, 0.9]],
                                "optim.lr": [load_config("tiny").optim.lr, 0.001], "train.max_steps": [4, 6]}
    from trainbox.optim.build import lr_multiplier
    lr5 = next(r["lr"] for r in rows if r["event"] == "train" and r["step"] == 5)
    assert lr5 == pytest.approx(0.001 * lr_multiplier(4, 6, cfg.optim))
    group = t.optimizers[0].param_groups[0]
    assert group["betas"] == (0.8, 0.9) and group["initial_lr"] == 0.001
    assert "lr: 0.001" in (run_dir / "config.yaml").read_text()
    assert _losses(run_dir)[5] != straight[5]   # it really trained with the new settings


@pytest.mark.faults
def test_changed_model_or_data_settings_on_resume_are_refused_listing_them(saved_run, tmp_path):
    root, base, _ = saved_run
    _copy_run(saved_run, "changed")
    with pytest.raises(ConfigError) as err:
        train(load_config(None, [*base, "run.name=changed", "train.max_steps=6", "model.n_embd=64", "data.seq_len=16"]))
    assert "data.seq_len: 32 -> 16" in err.value.message and "model.n_embd: 32 -> 64" in err.value.message
    assert "run.name=NEW_NAME" in err.value.hint and "run.resume=never" in err.value.hint
    proc = run_cli("train", *base, "run.name=changed", "train.max_steps=6", "run.seed=7", check=False)
    assert proc.returncode == 2 and "run.seed: 1337 -> 7" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- a new start in an old folder

@pytest.mark.faults
def test_resume_never_sets_the_old_run_aside_and_keeps_the_new_one(saved_run):
    root, base, straight = saved_run
    run_dir = _copy_run(saved_run, "again")
    train(load_config(None, [*base, "run.name=again", "train.max_steps=2", "run.resume=never", "train.keep_last=1"]))
    root_ck = run_dir / "checkpoints"
    assert [p.name for p in checkpoint.list_complete(root_ck)] == ["step_00000002"]
    assert (root_ck / "latest").read_text().strip() == "step_00000002"
    old = list((run_dir / "superseded").glob("*"))
    assert len(old) == 1 and sorted(p.name for p in (old[0] / "checkpoints").iterdir()) == \
        ["step_00000002", "step_00000004"]
    assert sorted(_losses(old[0])) == [1, 2, 3, 4]
    assert _losses(run_dir) == {s: straight[s] for s in (1, 2)}   # the new run's own history only
    with pytest.raises(RunFinished, match="step 2"):   # a plain rerun continues the new run, not the old one
        train(load_config(None, [*base, "run.name=again", "train.max_steps=2"]))


# ----------------------------------------------------------------------------- paths stay in the run directory

@pytest.mark.faults
@pytest.mark.parametrize("name", ["..", "../x", "/abs/run", "a/b", ".hidden"])
def test_run_names_are_one_safe_path_component(tiny, name, tmp_path):
    proc = run_cli("train", *tiny, f"run.name={name}", "train.max_steps=1", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "run.name" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.faults
def test_planted_symbolic_links_never_redirect_a_runs_writes(saved_run, tmp_path):
    root, base, _ = saved_run
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    run_dir = _copy_run(saved_run, "linked")
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(ConfigError, match="metrics.jsonl is a symbolic link"):
        train(load_config(None, [*base, "run.name=linked", "train.max_steps=6"]))
    assert outside.read_text() == "keep"
    (root / "elsewhere").mkdir()
    (root / "link-run").symlink_to(root / "elsewhere")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        train(load_config(None, [*base, "run.name=link-run", "train.max_steps=2"]))
    assert not any((root / "elsewhere").iterdir())
