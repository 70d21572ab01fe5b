"""The pretraining families on a CUDA GPU: short bf16 + torch.compile runs through the real training loop whose loss
falls, and the MoE layer's grouped-matmul path against its loop over experts in bf16.

Each run is `trainbox train RECIPE` in its own process (compile caches never mix) for 100 steps of 32 x 1024
tokens, micro-batch 16, on a corpus built by benchmarks/make_corpus.py from this machine's Python files.
`moe-128e` is 128 experts, capacity factor 2, top-2, load-balancing weight 0.05, with MoE in every 4th block so
that it fits one GPU (all 12 would be 7.3B parameters).

    python -m pytest -q -m gpu tests/test_gpu_models.py          # on the GPU machine
"""
from __future__ import annotations

import importlib
import json
import math
import statistics
import sys

import pytest
import torch
from conftest import REPO, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RUNS = {
    "gpt2-125m": ("gpt2-125m", []),
    "moe-gpt2-125m": ("moe-gpt2-125m", []),
    "moe-128e": ("moe-gpt2-125m", ["model.moe.num_experts=128", "model.moe.capacity_factor=2", "model.moe.top_k=2",
                                   "model.moe.lb_loss_weight=0.05", "train.micro_batch_size=16", "model.moe.every=4"]),
}
STEPS, BATCH = 100, 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A 4M-token GPT-2 corpus of this machine's Python files (the benchmark corpus's recipe); -> its prefix."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    make_corpus = importlib.import_module("make_corpus")   # by name: its worker processes unpickle its functions
    out = tmp_path_factory.mktemp("corpus")
    make_corpus.build(out, make_corpus.default_roots(), train_tokens=4_000_000, val_tokens=300_000,
                      shard_tokens=100_000_000, workers=2)
    return str(out / "modded" / "pyc")


@pytest.mark.slow   # 64 s (gpt2-125m) and 89 s (moe-gpt2-125m) on an H200: outside the 5-minute `gpu and not slow` set
@pytest.mark.parametrize("name", ["gpt2-125m", "moe-gpt2-125m", "moe-128e"])
def test_family_trains_compiled_in_bf16(name, corpus, tmp_path):
    recipe, extra = RUNS[name]
    run_cli("train", recipe, f"data.path={corpus}", f"train.max_steps={STEPS}", f"train.global_batch_size={BATCH}",
            "train.micro_batch_size=16", "train.dtype=bf16", "train.compile=true", "train.eval_every=0",
            "train.eval_tokens=262144", "train.checkpoint_every=0", "train.sample_tokens=0", "monitor.enabled=false",
            "monitor.log_every=10", "optim.warmup_steps=10", f"run.dir={tmp_path}", "run.name=check", *extra,
            timeout=1800)
    rows = [json.loads(line) for line in (tmp_path / "check" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("event") == "train"]
    losses = [r["loss"] for r in train]
    assert len(train) == STEPS and all(math.isfinite(v) for v in losses)
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10]) - 0.5, losses
    windows = [r for r in train if r.get("tokens_per_s")][1:]   # the first window holds compilation
    assert windows and all(r["tokens_per_s"] > 0 for r in windows)
    if recipe.startswith("moe"):
        assert any(k.startswith("moe") for k in train[-1]), sorted(train[-1])


def test_grouped_moe_layer_matches_the_loop_in_bf16():
    """The MoE layer's grouped-matmul path against its loop over experts: output, input and weight gradients."""
    from trainbox.model.moe.config import MoESection
    from trainbox.model.moe.model import MoEFFN

    torch.manual_seed(0)
    layer = MoEFFN(768, MoESection(num_experts=8, top_k=2), bias=True, dropout=0.0).cuda()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(4, 1024, 768, device="cuda")
    res = []
    for use_kernel in (True, False):
        layer.use_kernel = use_kernel
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.float().square().mean().backward()
        res.append((y.float(), xi.grad.float(), layer.c_fc.weight.grad.float()))
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(*res)]
    assert max(rel) < 2e-2, rel
