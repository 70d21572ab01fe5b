"""End to end through the CLI, as a user runs it: train, files, resume, finished run, generate."""
from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import run_cli


def _events(run_dir, kind="train"):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def test_train_writes_run_dir_then_resumes_and_generates(tmp_path, tiny):
    args = [*tiny, "train.max_steps=6", "train.eval_every=3", "train.checkpoint_every=3", "train.keep_last=1"]
    out = run_cli("train", "tiny", *args, cwd=tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    assert "bits/byte" in out.stdout and "--- sample ---" in out.stdout

    # the run directory as the README lists it
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["train"]["max_steps"] == 6 and cfg["model"]["n_embd"] == 32 and cfg["recipe"] == "tiny"
    env = json.loads((run_dir / "env.json").read_text())
    assert env["torch"] and env["python"] and "train" in env["command"]
    # the caching allocator with expandable segments unless the user chose (set before CUDA starts)
    mine = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    assert env["allocator"] == (mine or "expandable_segments:True")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "finished" and status["step"] == 6 and status["total_steps"] == 6
    assert [e["step"] for e in _events(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in _events(run_dir, "eval")] == [3, 6]
    assert all(e["val_bpb"] > 0 and e["val_loss"] > 0 for e in _events(run_dir, "eval"))
    assert (run_dir / "train.log").read_text().count("step ") >= 6
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_00000006"], ckpts  # keep_last=1 pruned step 3
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    step_dir = run_dir / "checkpoints" / "step_00000006"
    assert {p.name for p in step_dir.iterdir()} == {"COMPLETE", "model.safetensors", "optimizer.pt", "rng.pt",
                                                    "trainer.json"}
    trainer = json.loads((step_dir / "trainer.json").read_text())
    assert trainer["step"] == 6 and trainer["loader"]["step"] == 6 and trainer["finished"]

    # the same command again: the run is finished, and the user is told how to start a new one
    again = run_cli("train", "tiny", *args, cwd=tmp_path)
    assert "already finished" in again.stderr and "run.name=" in again.stderr

    # more steps: resumes from latest and continues the step count
    run_cli("train", "tiny", *args, "train.max_steps=9", cwd=tmp_path,
            env={"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.9"})
    assert json.loads((run_dir / "env.json").read_text())["allocator"] == "garbage_collection_threshold:0.9"
    assert [e["step"] for e in _events(run_dir)] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert "resuming from" in (run_dir / "train.log").read_text()
    starts = _events(run_dir, "start")
    assert [s["step"] for s in starts] == [0, 6] and starts[1]["resumed_from"].endswith("step_00000006")

    # generation: same seed -> same text; a checkpoint folder works in place of the run directory
    gen = ["--prompt", "ROMEO:", "--max-tokens", "30", "--temperature", "0.8", "--top-k", "50", "--seed", "1"]
    a = run_cli("generate", str(run_dir), *gen).stdout
    b = run_cli("generate", str(run_dir / "checkpoints" / "step_00000009"), *gen).stdout
    c = run_cli("generate", str(run_dir), *gen[:-1], "2").stdout
    assert a == b and a.startswith("ROMEO:") and len(a) > len("ROMEO:") + 10
    assert a != c


def test_generate_errors_on_missing_checkpoint(tmp_path):
    proc = run_cli("generate", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 1
    assert "no complete checkpoint" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_sampling_options_that_mean_nothing_are_refused_before_the_checkpoint_is_read(tmp_path, verb):
    proc = run_cli(verb, str(tmp_path / "nope"), "--top-p", "0", "--temperature", "-1", check=False)
    assert proc.returncode == 2 and "checkpoint" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"trainbox {verb}: --temperature -1.0: must be 0 (greedy) or more; --top-p 0.0: "
                                   "must be above 0 and at most 1 (1: off)")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without a CUDA GPU")
@pytest.mark.parametrize("verb", ["generate", "chat", "eval"])
def test_a_device_this_machine_lacks_is_refused_before_the_checkpoint_is_read(tmp_path, verb):
    extra = ["--tasks", "hellaswag"] if verb == "eval" else []
    for device, says in (("cuda", "--device cuda: no CUDA GPU is visible"),
                         ("tpu", "--device tpu: trainbox runs on cpu, cuda or cuda:N")):
        proc = run_cli(verb, str(tmp_path / "nope"), *extra, "--device", device, check=False)
        assert proc.returncode == 2 and "checkpoint" not in proc.stderr and "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"trainbox {verb}: {says}"), proc.stderr


def test_nproc_flag_help_lists_examples():
    out = run_cli("train", "--help").stdout
    assert "examples:" in out and "trainbox train gpt2-125m" in out


def test_nproc_picks_a_micro_batch_that_keeps_the_recipes_global_batch(tmp_path, data_cache):
    """tiny's micro-batch equals its global batch (32): on 2 processes trainbox trains 16 x 1 x 2, says so once,
    and refuses a given micro-batch that cannot hold with one message before any worker starts."""
    small = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=32", "train.max_steps=2",
             "train.eval_tokens=2048", "train.sample_tokens=0", "monitor.port=0", f"run.dir={tmp_path}",
             f"data.cache_dir={data_cache}"]
    proc = run_cli("train", "--nproc", "2", "tiny", *small)
    assert proc.stderr.count("train.micro_batch_size=16 on 2 processes") == 1, proc.stderr
    assert "global batch 32 = 16 x 1 accum x 2" in (tmp_path / "tiny" / "train.log").read_text()
    # the workers ran the layout the launcher decided (its config handed over, not re-decided from argv strings)
    env = json.loads((tmp_path / "tiny" / "env.json").read_text())
    assert env["layout"] == {"world": 2, "device": "cpu", "strategy": "ddp", "expert_parallel": 1, "micro_batch": 16,
                             "accumulation": 1, "global_batch": 32, "expert_exchange": "none"}
    assert "train.micro_batch_size=16" not in " ".join(env["command"])   # their command line is the user's
    bad = run_cli("train", "--nproc", "2", "tiny", *small, "train.micro_batch_size=12", "run.name=bad", check=False)
    assert bad.returncode == 2 and bad.stderr.count("train.micro_batch_size=12 does not divide") == 1, bad.stderr
    assert "launching" not in bad.stderr and not (tmp_path / "bad").exists()
