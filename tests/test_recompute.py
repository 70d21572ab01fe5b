"""train.activation_checkpointing: the same gradients for every family, what each mode re-runs in the
backward (counted at the aten level), and the loop (eager and compiled) training the same losses."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainbox.config import ModelSection, load_config
from trainbox.errors import ConfigError
from trainbox.model.build import build_model
from trainbox.train.loop import train
from trainbox.train.recompute import apply_activation_checkpointing

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
NORMS = {torch.ops.aten.native_layer_norm.default}

FAMILIES = {
    "gpt": dict(family="gpt", n_layer=2, n_head=2, n_embd=32, dropout=0.1),
    "moe": dict(family="moe", n_layer=2, n_head=2, n_embd=32),
    "speedrun": dict(family="speedrun", n_layer=2, n_head=2, n_embd=32, head_dim=16, window=8, eot_id=0),
    "t5": dict(family="t5", n_layer=2, n_head=2, n_embd=32),
    "llama": dict(family="llama", n_layer=2, n_head=2, n_embd=32, llama=dict(n_kv_head=1, intermediate_size=64)),
}
VOCAB = {"t5": 160}  # T5's vocabulary ends with its 100 sentinels


class Count(TorchDispatchMode):
    """How many times each aten op runs while active."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))

    def count(self, ops) -> int:
        return sum(n for f, n in self.calls.items() if f in ops)


def grads_and_backward_ops(family: str, mode: str, **model):
    torch.manual_seed(0)
    model = build_model(ModelSection(**{**FAMILIES[family], **model}), VOCAB.get(family, 64), 16)
    apply_activation_checkpointing(model, mode)
    model.train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(1, 64, (2, 16), generator=g), torch.randint(1, 64, (2, 16), generator=g)
    torch.manual_seed(2)  # dropout masks
    out = model(x, y)
    loss = out.loss + (out.aux_loss if out.aux_loss is not None else 0)
    counter = Count()
    with counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counter


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_gradients_equal_mode_none(family, mode):
    ref, _ = grads_and_backward_ops(family, "none")
    got, _ = grads_and_backward_ops(family, mode)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_what_each_mode_runs_again_in_the_backward():
    """none re-runs nothing; selective re-runs the norms but no matmul (their outputs were kept); full
    re-runs every block's forward, matmuls included (2 blocks x 4 linears)."""
    _, none = grads_and_backward_ops("gpt", "none")
    _, sel = grads_and_backward_ops("gpt", "selective")
    _, full = grads_and_backward_ops("gpt", "full")
    assert none.count(NORMS) == 0 and sel.count(NORMS) == 4 and full.count(NORMS) == 4
    assert sel.count(MATMULS) == none.count(MATMULS)
    assert full.count(MATMULS) == none.count(MATMULS) + 2 * 4


@pytest.mark.parametrize("capacity", [0.0, 0.5])
@pytest.mark.parametrize("bias", [False, True])
def test_experts_mode_recomputes_the_experts_hidden_layer_to_the_same_gradients(bias, capacity):
    """experts: the MoE layers keep only the rows that enter their experts; the backward runs the first grouped
    matmul again (and, eager, the second: model/moe/experts.py `recomputed`), to gradients equal to mode none's, with
    the experts' biases and with a capacity that drops assignments. The dense part is recomputed nowhere."""
    moe = {"bias": bias, "moe": {"num_experts": 4, "capacity_factor": capacity}}
    ref, none = grads_and_backward_ops("moe", "none", **moe)
    got, experts = grads_and_backward_ops("moe", "experts", **moe)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)
    grouped = {torch.ops.aten._grouped_mm.default}
    assert none.count(grouped) == 2 * 4   # 2 MoE layers: each linear's input and weight gradients
    assert experts.count(grouped) == none.count(grouped) + 2 * 2
    assert experts.count(NORMS) == none.count(NORMS) == 0 and experts.count(MATMULS) == none.count(MATMULS)


def test_experts_mode_is_refused_where_there_are_no_experts():
    with pytest.raises(ConfigError, match="has no experts: use selective or full"):
        load_config("gpt2-125m", ["train.activation_checkpointing=experts"])
    assert load_config("moe-gpt2-125m", ["train.activation_checkpointing=experts"]).train.activation_checkpointing \
        == "experts"


@pytest.mark.parametrize("compile_", [False, True])
def test_loop_trains_the_same_losses(tiny, compile_):
    def losses(mode):
        cfg = load_config(None, [*tiny, f"run.name=ac-{mode}-{compile_}", "train.max_steps=3", "monitor.enabled=false",
                                 "train.eval_every=0", "train.sample_tokens=0", f"train.compile={compile_}",
                                 f"train.activation_checkpointing={mode}"])
        train(cfg)
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["event"] == "train"]

    ref = losses("none")
    assert len(ref) == 3
    assert losses("selective") == pytest.approx(ref, rel=1e-5)


def test_hf_family_points_to_lora_gradient_checkpointing():
    with pytest.raises(ConfigError, match="lora.gradient_checkpointing"):
        load_config("lora", ["model.path=some/model", "train.activation_checkpointing=full"])
