"""A run that cannot work fails before it trains, with one message that says what to change: validation or
training data without one sample at data.seq_len, a run that does not fit the machine's memory
(train/memory.py), a GPU recipe on a CPU, an out-of-memory in a step or an evaluation, a Hugging Face
model folder without tokenizer files."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
from conftest import run_cli

from trainbox.config import load_config
from trainbox.errors import ConfigError, DataError, TrainingFailed


@pytest.fixture
def small_corpus(tmp_path):
    """300 short documents: 1% (3 documents, a few hundred tokens) are held out for validation."""
    path = tmp_path / "small.jsonl"
    lines = [json.dumps({"text": f"Document {i}: to be or not to be, that is the question. " * 4})
             for i in range(300)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_validation_without_a_sample_fails_before_training(tiny, small_corpus):
    from trainbox.train.loop import train
    cfg = load_config("tiny", [*tiny, f"data.path={small_corpus}", "data.seq_len=512", "train.max_steps=2",
                               "train.global_batch_size=2", "train.micro_batch_size=2"])
    with pytest.raises(DataError) as e:
        train(cfg)
    msg = str(e.value)
    assert "data.seq_len=512" in msg and "validation data holds" in msg and "tokens" in msg
    assert "lower data.seq_len (at most" in msg and "more validation data" in msg
    assert not (cfg.run_dir / "checkpoints").exists()   # refused before the first step, not after the last


def test_training_data_without_a_sample_names_seq_len(tiny, small_corpus):
    from trainbox.train.loop import train
    cfg = load_config("tiny", [*tiny, f"data.path={small_corpus}", "data.seq_len=100000", "train.max_steps=2"])
    with pytest.raises(DataError) as e:
        train(cfg)
    msg = str(e.value)
    assert "data.seq_len=100000" in msg and "the training data holds" in msg
    assert "Lower data.seq_len (at most" in msg and "(at most 0)" not in msg


def test_memory_check_refuses_beyond_the_plans_margin():
    """The pre-flight check refuses a run whose plan (trainbox.plan) exceeds the free memory by more than the
    plan's margin, says what would fit, and is off with train.memory_check=false."""
    from trainbox.plan import MARGIN
    from trainbox.train.memory import check_memory
    cfg = load_config("tiny", ["train.device=cpu", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                               "data.seq_len=32", "train.micro_batch_size=4", "train.global_batch_size=8",
                               "optim.name=adamw"])
    cpu = torch.device("cpu")
    plan = check_memory(cfg, 1024, cpu, torch.float32, free=10**12)
    total = plan.memory.needed
    n = plan.counts.total
    assert plan.memory.params == plan.memory.gradients == 4 * n and plan.memory.optimizer == 8 * n   # AdamW
    assert check_memory(cfg, 1024, cpu, torch.float32, free=total) is not None
    low = math.ceil(total * (1 - MARGIN))     # the low end of the plan's margin
    assert check_memory(cfg, 1024, cpu, torch.float32, free=low) is not None
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, 1024, cpu, torch.float32, free=low - 1)
    assert "train.micro_batch_size" in e.value.hint and "train.memory_check=false" in e.value.hint
    off = cfg.model_copy(update={"train": cfg.train.model_copy(update={"memory_check": False})})
    assert check_memory(off, 1024, cpu, torch.float32, free=1) is None
    muon = load_config("tiny", ["optim.name=muon", "model.n_layer=2", "model.n_embd=32", "model.n_head=2"])
    m = check_memory(muon, 1024, cpu, torch.float32, free=10**12)
    assert 4 * m.counts.total < m.memory.optimizer < 8 * m.counts.total   # Muon's matrices keep one momentum


def test_memory_check_gives_each_cpu_process_its_share_of_the_hosts_ram():
    """The processes of a run on one host share its RAM: each is held to its share of the available figure, so two
    processes that each need more than half of it are refused (the message names the share), while the same
    processes spread one per host (`local_world=1`) each have it whole."""
    from trainbox.train.memory import check_memory
    cfg = load_config("tiny", ["train.device=cpu", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                               "data.seq_len=64", "train.micro_batch_size=8", "train.global_batch_size=16",
                               "optim.name=adamw"])
    cpu = torch.device("cpu")
    needed = check_memory(cfg, 1024, cpu, torch.float32, free=10**12, world=2).memory.needed
    free = int(1.5 * needed)   # holds one process's need whole, not in half of it
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, 1024, cpu, torch.float32, free=free, world=2)
    assert f"per process of this machine's available RAM ({free / 2**30:.1f} GiB shared by the run's 2 processes" \
        in str(e.value)
    plan = check_memory(cfg, 1024, cpu, torch.float32, free=free, world=2, local_world=1)
    assert plan is not None and plan.target.memory == free
    assert check_memory(cfg, 1024, cpu, torch.float32, free=2 * needed, world=2).target.memory == needed


def test_run_that_does_not_fit_is_refused_before_the_model(tmp_path, data_cache):
    """gpt2-125m at its micro-batch of 120 on a 24 GB CPU machine would grow until the kernel killed it: refused."""
    corpus = tmp_path / "corpus.jsonl"   # ~190k GPT-2 tokens: one global batch of 120 x 1024, and validation
    corpus.write_text("".join(json.dumps({"text": f"Line {i}: to be or not to be, that is the question. " * 5}) + "\n"
                              for i in range(3000)))
    start = time.monotonic()
    proc = run_cli("train", "gpt2-125m", f"data.path={corpus}", "train.device=cpu", "train.global_batch_size=120",
                   "monitor.enabled=false",
                   f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={data_cache}", cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "this run needs about" in out and "GiB" in out and "available RAM" in out
    assert "train.micro_batch_size=120" in out and "lower train.micro_batch_size" in out
    assert "train.activation_checkpointing=full" in out and "Traceback" not in out
    assert time.monotonic() - start < 120
    assert not (tmp_path / "runs" / "gpt2-125m" / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_gpu_recipe_on_cpu():
    from trainbox.doctor import recipe_checks
    from trainbox.train.device import resolve_device
    for name in ("gpt2-125m", "moe-gpt2-125m", "speedrun-124m", "speedrun-350m", "t5-base", "llama-1b", "llama-8b"):
        cfg = load_config(name)
        assert cfg.requires_gpu
        with pytest.raises(ConfigError) as e:
            resolve_device(cfg)
        assert "made for a GPU" in str(e.value) and f"trainbox train {name} train.device=cpu" in e.value.hint
    device, _, _ = resolve_device(load_config("speedrun-124m", ["train.device=cpu"]))
    assert device.type == "cpu"   # asked for explicitly: the memory check decides
    assert not any(load_config(name).requires_gpu for name in ("tiny", "t5-small", "sft"))
    checks = {c.name: c for c in recipe_checks(load_config("speedrun-124m"))}
    assert checks["needs_gpu"].status == "fail" and "made for a GPU" in checks["needs_gpu"].value
    assert "needs_gpu" not in {c.name for c in recipe_checks(load_config("speedrun-124m", ["train.device=cpu"]))}


CPU_OOM = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 25769803776 bytes. "
           "Error code 12 (Cannot allocate memory)")


def test_cpu_out_of_memory_in_a_step_is_one_message(tiny, monkeypatch):
    from trainbox.train import loop

    def no_memory(self, step):
        raise RuntimeError(CPU_OOM)
    monkeypatch.setattr(loop.Trainer, "train_step", no_memory)
    with pytest.raises(TrainingFailed) as e:
        loop.train(load_config("tiny", [*tiny, "train.max_steps=2"]))
    msg = str(e.value)
    assert "out of memory (RAM) in step 1 at train.micro_batch_size=4" in msg
    assert "lower train.micro_batch_size (e.g. 2)" in msg and "DefaultCPUAllocator" in msg


def test_cpu_out_of_memory_in_evaluation_is_one_message(tiny, monkeypatch):
    """The tiny run passes the memory check and trains; its evaluation (the objective's) runs out of memory."""
    from trainbox.objective import next_token
    from trainbox.train import loop

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] not enough memory: you tried to allocate 1 GB")
    monkeypatch.setattr(next_token, "evaluate", no_memory)
    with pytest.raises(TrainingFailed) as e:
        loop.train(load_config("tiny", [*tiny, "train.max_steps=1"]))
    assert "out of memory (RAM) in the evaluation after step 1" in str(e.value)
    assert "train.micro_batch_size" in e.value.hint


def test_hf_folder_without_tokenizer_files(tmp_path):
    from trainbox.data.sft import load_hf_tokenizer
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(DataError) as e:
        load_hf_tokenizer(str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path) in msg and "tokenizer.json" in msg and "vocab.json + merges.txt" in msg
    assert "tokenizer.model" in msg

