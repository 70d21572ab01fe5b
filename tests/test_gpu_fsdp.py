"""FSDP on two GPUs over NCCL: the sharded gradients that FSDP reduce-scatters on its side stream live in the
compute stream's memory pool (parallel/grad_pool.py, GradsOnComputeStream), and the steps equal one GPU's.

A 16-layer Llama in fp32, 4 steps of 2 micro-batches per rank (the second micro-batch's reduce-scatter output is
added into the first's gradient and freed: the path where memory reuse across streams could race). The
allocator's history (monitor.memory_snapshot) gives the pools by stream at the reserved peak: the side streams
hold the gathered blocks, about one block's parameters twice, and not rank 0's share of every gradient.

    python -m pytest -q -m gpu tests/test_gpu_fsdp.py          # on a machine with 2 or more GPUs
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, run_cli

from trainbox.config import load_config
from trainbox.train.loop import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

LLAMA = ["model.family=llama", "model.n_layer=16", "model.n_embd=512", "model.n_head=8", "model.llama.n_kv_head=4",
         "model.llama.intermediate_size=1536", "model.llama.tie_embeddings=false"]


def _losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("event") == "train"]


def test_gradients_live_in_the_compute_pool_and_two_gpus_equal_one(tmp_path, data_cache):
    own = [o for o in TINY if not o.startswith("monitor.log_every")]
    base = [*own, *LLAMA, "train.max_steps=4", "train.dtype=fp32", "train.compile=false",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_tokens=512", "train.sample_tokens=0",
            "train.checkpoints=false", "monitor.log_every=1", f"run.dir={tmp_path}", f"data.cache_dir={data_cache}"]
    torch.backends.cuda.matmul.allow_tf32 = False
    # one start for both: under fsdp a GPU's generator initialises the model, on one process the CPU's
    train(load_config("tiny", [*base, "run.name=init", "train.max_steps=1", "train.checkpoints=true",
                               "monitor.port=0"]))
    start = f"run.init_from={tmp_path / 'init' / 'checkpoints' / 'step_00000001'}"
    train(load_config("tiny", [*base, start, "run.name=one", "monitor.port=0"]))
    run_cli("train", "--nproc", "2", "tiny", *base, start, "run.name=two", "train.parallel=fsdp", "monitor.port=0",
            "monitor.memory_snapshot=4", timeout=900)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 4
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)

    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    params = next(r["params"] for r in rows if r.get("event") == "start")
    grad_shard_gib = params * 4 / 2 / 2**30   # a rank's fp32 share of every gradient
    for rank in (0, 1):
        peak = json.loads((tmp_path / "two" / f"memory_peak.rank{rank}.json").read_text())
        pools = peak["pools_at_reserved_peak_gib"]
        side = sum(v for stream, v in pools.items() if stream != "0")
        assert side < 0.75 * grad_shard_gib, (pools, grad_shard_gib)
