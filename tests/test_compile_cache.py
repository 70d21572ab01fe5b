"""The compile cache across processes: a second start of a compiled model loads its graphs instead of
tracing them again (what makes a restarted or requeued run start in seconds)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from trainbox.config import ModelSection
from trainbox.model.build import build_model
from trainbox.train.build import allow_cached_autograd_functions
allow_cached_autograd_functions()
torch.manual_seed(0)
cfg = ModelSection(family="speedrun", n_layer=1, n_embd=64, n_head=2, head_dim=32, window=32, eot_id=0,
                   fused_loss=True, fp8_mlp="down", fp8_head=True)
model = build_model(cfg, 128, 64)
model.set_step(0)
idx = torch.randint(1, 128, (1, 65), generator=torch.Generator().manual_seed(1))
loss = torch.compile(model)(idx[:, :-1], idx[:, 1:]).loss
loss.backward()
print(json.dumps({"loss": loss.item(), "grad": model.lm_head.weight.grad.norm().item(),
                  **{k: v for k, v in counters["aot_autograd"].items()}}))
"""


@pytest.mark.slow
def test_second_start_loads_the_autograd_graphs(tmp_path):
    """The speedrun model with the fused loss and FP8 (torch.autograd.Functions in the graph): the first
    process saves its forward/backward graph, the second loads it (AOTAutograd cache hit, no bypass) and
    computes the same loss and gradients."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first.get("autograd_cache_saved", 0) >= 1 and not first.get("autograd_cache_bypass")
    assert second.get("autograd_cache_hit", 0) >= 1 and not second.get("autograd_cache_miss")
    assert second["loss"] == first["loss"] and second["grad"] == first["grad"]
