"""Python's garbage collection while training (train/collect.py): automatic collection off inside the loop, the
young generations collected every train.gc_every steps and a full pass where the loop evaluates or saves; the
collector as it was found afterwards; and no reference cycles holding tensors in a family's training steps, which
would otherwise live up to train.gc_every steps."""
from __future__ import annotations

import gc

import hf_tiny
import pytest
import torch
from conftest import TINY

from trainbox.config import load_config
from trainbox.train import collect, loop


def _events(monkeypatch, cfg) -> list:
    """("step", n) as each step starts and ("gc", generation) for each collection, from the first step on."""
    events: list = []
    step = loop.Trainer.train_step
    monkeypatch.setattr(loop.Trainer, "train_step", lambda self, s: (events.append(("step", s + 1)), step(self, s))[1])

    def seen(phase, info):
        if phase == "start" and events:
            events.append(("gc", info["generation"]))
    gc.callbacks.append(seen)
    try:
        loop.train(cfg)
    finally:
        gc.callbacks.remove(seen)
    return events


def test_collections_run_at_step_boundaries_only(tmp_path, data_cache, monkeypatch):
    base = [*TINY, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}", "train.max_steps=8", "train.eval_every=4",
            "train.sample_tokens=0"]
    got = _events(monkeypatch, load_config("tiny", [*base, "run.name=steps", "train.gc_every=3"]))
    # young generations after steps 3 and 6; full passes after the evaluation of step 4 and the evaluation and save
    # of step 8; nothing automatic in between
    assert got == [("step", 1), ("step", 2), ("step", 3), ("gc", 1), ("step", 4), ("gc", 2), ("step", 5),
                   ("step", 6), ("gc", 1), ("step", 7), ("step", 8), ("gc", 2)], got
    assert gc.isenabled()
    # train.gc_every=0: Python's own collections, wherever allocations trip them
    auto = _events(monkeypatch, load_config("tiny", [*base, "run.name=auto", "train.gc_every=0"]))
    assert [e for e in auto if e[0] == "step"] == [("step", s) for s in range(1, 9)]
    assert ("gc", 0) in auto


def test_a_collector_the_caller_turned_off_stays_off(tmp_path, data_cache):
    gc.disable()
    try:
        loop.train(load_config("tiny", [*TINY, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}",
                                        "train.max_steps=2", "train.sample_tokens=0", "train.gc_every=1"]))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_objects_the_process_froze_stay_frozen(tmp_path, data_cache):
    """A process that froze objects of its own before training (a server that forks workers) finds them frozen
    after the loop; the loop's own run froze and released what it made."""
    held = [object() for _ in range(1000)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        loop.train(load_config("tiny", [*TINY, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}",
                                        "train.max_steps=2", "train.sample_tokens=0", "train.gc_every=1"]))
        # still frozen (objects freed meanwhile leave the count), and nothing of the run's added
        assert 0 < gc.get_freeze_count() <= frozen and gc.isenabled()
    finally:
        gc.unfreeze()
    assert held
    # on its own, the loop leaves nothing frozen
    loop.train(load_config("tiny", [*TINY, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}", "run.name=own",
                                    "train.max_steps=2", "train.sample_tokens=0", "train.gc_every=1"]))
    assert gc.get_freeze_count() == 0


def _tensors_in_cycles(monkeypatch, cfg) -> tuple[list, list]:
    """(the steps of the full passes, the tensors each found unreachable) of a run with DEBUG_SAVEALL on."""
    found, passes = [], []
    after = collect.StepCollector.after_step

    def read(self, step, paused):
        after(self, step, paused)
        if paused:
            passes.append(step)
            found.extend((step, tuple(o.shape)) for o in gc.garbage if isinstance(o, torch.Tensor))
            gc.garbage.clear()
    monkeypatch.setattr(collect.StepCollector, "after_step", read)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        loop.train(cfg)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return passes, found


@pytest.mark.parametrize("family", [["model.family=gpt"],
                                    ["model.family=moe", "model.moe.num_experts=4", "model.moe.top_k=2"],
                                    ["model.family=llama", "train.activation_checkpointing=selective"],
                                    ["model.family=t5", "model.tie_embeddings=false", "model.t5.d_ff=64",
                                     "model.t5.d_kv=16"]],
                         ids=["gpt", "moe", "llama", "t5"])
def test_training_steps_leave_no_cycles_holding_tensors(tmp_path, data_cache, monkeypatch, family):
    """What the steps and evaluations left unreachable, read at each full pass while the run still holds its model
    (gc.DEBUG_SAVEALL keeps it in gc.garbage): no tensor, so collecting only every train.gc_every steps keeps no
    activation or gradient alive longer."""
    passes, found = _tensors_in_cycles(monkeypatch, load_config(
        "tiny", [*TINY, *family, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}", "train.max_steps=6",
                 "train.eval_every=2", "train.sample_tokens=0", "train.gc_every=1000"]))
    assert passes == [2, 4, 6] and found == [], (passes, found[:10])


@pytest.mark.parametrize("model", [[], ["model.family=hf"]], ids=["llama-folder", "hf-lora"])
def test_preference_steps_leave_no_cycles_holding_tensors(tmp_path, monkeypatch, model):
    """The same for the dpo recipe on a tiny Hugging Face folder: every weight (the llama family) and LoRA
    adapters on the transformers model (model.family=hf, peft)."""
    folder = hf_tiny.make_model(tmp_path / "base", seed=1)
    prefs = hf_tiny.make_preference_file(tmp_path / "train.jsonl", n=32, seed=0)
    passes, found = _tensors_in_cycles(monkeypatch, load_config("dpo", [
        f"model.path={folder}", f"data.path={prefs}", "data.seq_len=48", "train.global_batch_size=8",
        "train.micro_batch_size=4", f"run.dir={tmp_path}", "run.name=dpo", f"data.cache_dir={tmp_path / 'cache'}",
        "monitor.enabled=false", "train.sample_tokens=0", "train.threads=1", "train.max_steps=4",
        "train.checkpoint_every=2", "train.gc_every=1000", *model]))
    assert passes == [2, 4] and found == [], (passes, found[:10])
