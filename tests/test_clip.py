"""Gradient clipping (optim/clip.py): folded into torch's fused AdamW step where every optimizer is one, done in
place otherwise; either way the step equals torch.nn.utils.clip_grad_norm_ followed by the same optimizer."""
from __future__ import annotations

import pytest
import torch

from trainbox.optim.adamw import BF16StateAdamW, SplitAdamW
from trainbox.optim.clip import clip_, folds_into_step


def _params(seed: int, grad_scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((64, 48), (48,), (7, 5, 3))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * grad_scale
    return params


@pytest.mark.parametrize("grad_scale,max_norm", [(3.0, 1.0), (0.01, 1.0)], ids=["clipped", "under the norm"])
def test_a_fused_adamw_step_takes_the_clip_and_equals_clip_grad_norm_then_step(grad_scale, max_norm):
    ref, ours = _params(0, grad_scale), _params(0, grad_scale)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1, fused=True)
    assert folds_into_step([opt])
    for step in range(3):
        if step:   # new gradients, alike on both sides
            for a, b, g in zip(ref, ours, _params(step, grad_scale)):
                a.grad, b.grad = g.grad.clone(), g.grad.clone()
        before = [p.grad.clone() for p in ours]
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        norm = clip_(ours, max_norm, [opt])
        torch.testing.assert_close(norm, norm_ref, rtol=0, atol=0)
        # folded: the gradients are untouched until the step reads them
        assert all(torch.equal(a, p.grad) for a, p in zip(before, ours))
        opt_ref.step()
        opt.step()
        for a, b in zip(ref, ours):   # g / s against g * (1 / s): a rounding apart
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        for a, b in zip(opt_ref.state.values(), opt.state.values()):
            torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"], rtol=1e-5, atol=1e-12)


def test_optimizers_without_a_gradient_scale_are_clipped_in_place():
    """foreach AdamW, bf16-state AdamW, or a mix with a fused one: the gradients are multiplied before the step,
    exactly as clip_grad_norm_ does."""
    def fused(ps):
        return SplitAdamW(ps, lr=1e-2, fused=True)

    assert folds_into_step([fused(_params(0, 1.0))])
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: BF16StateAdamW(ps, lr=1e-2, fused=False),
                 lambda ps: torch.optim.SGD(ps, lr=1e-2)):
        ref, ours = _params(1, 3.0), _params(1, 3.0)
        optimizers = [make(ours[:2]), fused(ours[2:])]
        assert not folds_into_step(optimizers)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        torch.testing.assert_close(clip_(ours, 1.0, optimizers), norm_ref, rtol=0, atol=0)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref, ours))
        assert all(getattr(o, "grad_scale", None) is None for o in optimizers)


SHARDED = r"""
import tempfile, torch, torch.distributed as dist
from trainbox.config import ModelSection
from trainbox.model.build import build_model
from trainbox.optim.adamw import adamw_groups
from trainbox.optim.clip import clip_
from trainbox.parallel.distributed import Dist
from trainbox.parallel.fsdp import ShardedParallel
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
weights = {}
for fold in (True, False):
    torch.manual_seed(0)
    model = build_model(ModelSection(n_layer=2, n_head=2, n_embd=32), 64, 16)
    ShardedParallel(model, Dist(), torch.device("cpu"), torch.float32, reshard_after_forward=True, compile=False)
    groups = adamw_groups(list(model.named_parameters()), 0.1, 1e-2)
    opt = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    for _ in range(2):
        (model(idx[:, :-1], idx[:, 1:]).loss * 50).backward()   # a norm well over 0.5: every step clips
        params = [p for p in model.parameters() if p.grad is not None]
        norm = clip_(params, 0.5, [opt]) if fold else torch.nn.utils.clip_grad_norm_(params, 0.5).full_tensor()
        assert type(norm) is torch.Tensor and norm > 1, norm   # a plain tensor of the whole norm
        assert (getattr(opt, "grad_scale", None) is not None) == fold
        opt.step()
        opt.zero_grad()
    weights[fold] = [p.full_tensor() for p in model.parameters()]
    weights[fold] += [s["exp_avg"].full_tensor() for s in opt.state.values()]   # linear in the clipped gradient
# AdamW's update of an element whose gradient is near 0 moves with a rounding of it: 2e-5 is 0.2% of a step
assert all(torch.allclose(a, b, rtol=1e-5, atol=2e-5) for a, b in zip(weights[True], weights[False]))
print("ok")
"""


def test_sharded_parameters_take_the_clip_in_the_fused_step():
    """FSDP2's DTensor parameters (one rank, gloo): the fused AdamW step takes the folded clip's scale, a plain
    tensor, beside DTensors, and steps as clip_grad_norm_ then the step."""
    from conftest import run_check_script
    run_check_script(SHARDED)
