"""The kernel choice is made by one function (kernels.choice.choose): the models use it, the trainer records it
in env.json and the start event, and doctor prints it."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

from trainbox.config import load_config
from trainbox.kernels.choice import choose
from trainbox.model.build import build_model
from trainbox.model.spec import family as family_spec
from trainbox.train.loop import train


@pytest.mark.parametrize("family, extra, attention", [
    ("gpt", ["model.fused_loss=true", "model.fused_norm=true", "model.fused_mlp=true"], "sdpa"),
    ("speedrun", ["model.head_dim=16"], "sdpa"),
    ("t5", [], "sdpa"),
])
def test_the_run_records_what_the_model_runs(tiny, family, extra, attention):
    cfg = load_config(None, [*tiny, f"model.family={family}", *extra, "run.name=k", "train.max_steps=1",
                             "monitor.enabled=false", "train.sample_tokens=0"])
    train(cfg)
    env = json.loads((cfg.run_dir / "env.json").read_text())
    start = next(json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
                 if json.loads(x)["event"] == "start")
    want = choose(cfg.model, torch.device("cpu"), family_spec(cfg.model.family)).as_dict()
    assert env["kernels"] == start["kernels"] == want and want["attention"] == attention
    if family == "gpt":
        assert want == {"attention": "sdpa", "fused_loss": "torch", "fused_norm": "torch", "fused_mlp": "torch",
                        "fp8": "off", "packed": "off"}
        model = build_model(cfg.model, 2048, cfg.data.seq_len)
        assert model.set_kernels(torch.device("cpu")).as_dict() == want   # the model asks the same function


def test_doctor_prints_the_same_choice(tiny):
    out = run_cli("doctor", "tiny", "model.fused_loss=true", check=False).stdout
    line = next(x for x in out.splitlines() if " kernels " in f" {x} ")
    cfg = load_config("tiny", ["model.fused_loss=true"])
    assert choose(cfg.model, torch.device("cpu"), family_spec(cfg.model.family)).describe() in line
