"""model.fused_mlp: the GELU MLP as one op (kernels/fused_mlp.py) against nn.Linear + F.gelu: outputs and every
gradient, the gpt model eager and compiled, the config's refusals, and QuACK's kernels on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from trainbox.config import ModelSection
from trainbox.kernels.fused_mlp import gelu_mlp, moe_gelu_mlp
from trainbox.model.build import build_model


def unfused(x, w1, w2):
    return F.linear(F.gelu(F.linear(x, w1), approximate="tanh"), w2)


def _grads(f, x, w1, w2, gy):
    for t in (x, w1, w2):
        t.grad = None
    y = f(x, w1, w2)
    y.backward(gy)
    return [y.detach().clone()] + [t.grad.clone() for t in (x, w1, w2)]


NAMES = ["y", "dx", "dw1", "dw2"]


def _assert_matches(ours, ref, dtype):
    """Output and three gradients equal the reference's to fp32 / bf16 rounding, and are not all zero."""
    for name, a, b in zip(NAMES, ours, ref):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, name
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6
        assert (a.double() - b.double()).abs().max() <= tol * b.double().abs().max(), name
        assert b.abs().sum() > 0, name


def _assert_no_worse(ours, ref, exact):
    """GPU kernels: each result's error against fp64 within 1.5x of the bf16 torch reference's."""
    for name, a, b, e in zip(NAMES, ours, ref, exact):
        assert torch.isfinite(a).all(), name
        err_ours, err_ref = ((t.double() - e).abs().max() / e.abs().max() for t in (a, b))
        assert err_ours <= 1.5 * err_ref + 1e-3, (name, err_ours.item(), err_ref.item())


def _quack_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trainbox.kernels.fused_mlp import quack_available
    dev = torch.device("cuda")
    if not quack_available(dev):
        pytest.skip("QuACK (trainbox[flash]) on a Hopper/Blackwell GPU")
    return dev


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_gradients_equal_torch(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16).to(dtype).requires_grad_()
    w1 = (torch.randn(64, 16) * 0.3).to(dtype).requires_grad_()
    w2 = (torch.randn(16, 64) * 0.3).to(dtype).requires_grad_()
    gy = torch.randn(3, 7, 16).to(dtype)
    _assert_matches(_grads(gelu_mlp, x, w1, w2, gy), _grads(unfused, x, w1, w2, gy), dtype)


def test_gradients_need_the_gelu_derivative():
    """The reference is not vacuous: GELU' and the recomputed GELU(h) in dw2 each change the gradients."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(5, 8, requires_grad=True), torch.randn(32, 8, requires_grad=True), \
        torch.randn(8, 32, requires_grad=True)
    gy = torch.randn(5, 8)
    ours = _grads(gelu_mlp, x, w1, w2, gy)
    relu = _grads(lambda a, b, c: F.linear(F.relu(F.linear(a, b)), c), x, w1, w2, gy)
    exact = _grads(lambda a, b, c: F.linear(F.gelu(F.linear(a, b)), c), x, w1, w2, gy)
    for a, b, c in zip(ours[1:], relu[1:], exact[1:]):
        assert (a - b).abs().max() > 1e-2 and (a - c).abs().max() > 1e-6


def experts_unfused(x, w1, w2, sizes):
    """Expert e's slice of rows through its own F.linear + GELU + F.linear, by autograd."""
    outs, lo = [], 0
    for e, n in enumerate(sizes):
        outs.append(F.gelu(x[lo:lo + n] @ w1[e], approximate="tanh") @ w2[e])
        lo += n
    return torch.cat(outs)


def _expert_inputs(sizes, C, F_, dtype, device="cpu"):
    E, M = len(sizes), sum(sizes)
    x = torch.randn(M, C, device=device).to(dtype).requires_grad_()
    w1 = (torch.randn(E, C, F_, device=device) * C ** -0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, F_, C, device=device) * F_ ** -0.5).to(dtype).requires_grad_()
    offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    return x, w1, w2, offsets, torch.randn(M, C, device=device).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_op_equals_a_loop_over_experts(dtype):
    """The MoE experts' op against per-expert linears; expert 2 gets no rows (its weight gradients are 0)."""
    torch.manual_seed(0)
    sizes = [5, 9, 0, 3]
    x, w1, w2, offsets, gy = _expert_inputs(sizes, 16, 48, dtype)
    ours = _grads(lambda a, b, c: moe_gelu_mlp(a, b, c, offsets), x, w1, w2, gy)
    _assert_matches(ours, _grads(lambda a, b, c: experts_unfused(a, b, c, sizes), x, w1, w2, gy), dtype)
    assert not ours[2][2].any() and not ours[3][2].any()


def moe_model(capacity_factor=0.0):
    return dict(family="moe", moe=dict(num_experts=4, top_k=2, capacity_factor=capacity_factor))


def _pair(**extra):
    """The same small model unfused and with model.fused_mlp, equal weights (gpt unless extra says moe)."""
    torch.manual_seed(0)
    kw = dict(family="gpt", n_layer=2, n_head=2, n_embd=32, bias=False, dropout=0.0)
    kw.update(extra)
    a = build_model(ModelSection(**kw), vocab_size=64, block_size=16)
    b = build_model(ModelSection(**kw, fused_mlp=True), vocab_size=64, block_size=16)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("model", [{}, moe_model(), moe_model(1.0)], ids=["gpt", "moe", "moe-capacity-1"])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_model_loss_and_gradients_equal_unfused(model, fused_norm):
    """Loss (and the MoE aux loss) and every parameter's gradient, the router's included; with capacity
    1.0 some expert assignments are dropped."""
    a, b = _pair(fused_norm=fused_norm, **model)
    assert all(blk.mlp.fused for blk in b.transformer.h) and not any(blk.mlp.fused for blk in a.transformer.h)
    idx = torch.randint(0, 64, (3, 16))
    outs = []
    for m in (a, b):
        out = m(idx, idx)
        (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
        outs.append(out)
    if model.get("moe", {}).get("capacity_factor"):
        assert outs[1].stats["moe.0.dropped_frac"] > 0
    assert torch.allclose(outs[0].loss, outs[1].loss, rtol=1e-5, atol=0)
    if outs[0].aux_loss is not None:
        assert torch.allclose(outs[0].aux_loss, outs[1].aux_loss, rtol=1e-5, atol=0)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("model", [{}, moe_model()], ids=["gpt", "moe"])
def test_compiled_model_under_autocast_is_one_graph(model):
    a, b = _pair(fused_norm=True, **model)
    idx = torch.randint(0, 64, (2, 16))
    compiled = torch.compile(b, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_c = compiled(idx, idx).loss
        loss_a = a(idx, idx).loss
    loss_c.backward()
    loss_a.backward()
    assert abs(loss_c.item() - loss_a.item()) < 2e-2 * loss_a.item()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        scale = pa.grad.abs().max()
        assert (pa.grad - pb.grad).abs().max() <= 0.05 * scale, n


@pytest.mark.parametrize("kw, msg", [(dict(family="speedrun"), "model.family=gpt or moe"),
                                     (dict(bias=False, fp8_mlp="down"), "model.fp8_mlp=none")])
def test_config_refuses_what_it_cannot_fuse(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        ModelSection(fused_mlp=True, **kw)


def test_mlps_with_biases_run_unfused():
    """model.bias=true (GPT-2's own weights) with the recipe's fused_mlp: the MLP keeps its biases, unfused."""
    torch.manual_seed(0)
    m = build_model(ModelSection(family="gpt", n_layer=1, n_head=2, n_embd=32, bias=True, fused_mlp=True),
                    vocab_size=64, block_size=16)
    mlp = m.transformer.h[0].mlp
    assert not mlp.fused and mlp.c_fc.bias is not None
    with torch.no_grad():
        mlp.c_fc.bias.normal_()
        mlp.c_proj.bias.normal_()
    x = torch.randn(2, 5, 32)
    ref = F.linear(F.gelu(F.linear(x, mlp.c_fc.weight, mlp.c_fc.bias), approximate="tanh"), mlp.c_proj.weight,
                   mlp.c_proj.bias)
    assert torch.allclose(mlp(x), ref, atol=1e-6)


@pytest.mark.gpu
def test_quack_kernels_match_torch_on_gpu():
    """QuACK's epilogue GEMMs at gpt2-125m's MLP shapes (one micro-batch of 49,152 tokens would be the real
    size; 8,192 keeps the check quick), bf16: outputs and gradients against the unfused bf16 graph."""
    dev = _quack_device()
    torch.manual_seed(0)
    x = torch.randn(8192, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(3072, 768, device=dev) * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(768, 3072, device=dev) * 0.02).bfloat16().requires_grad_()
    gy = torch.randn(8192, 768, device=dev, dtype=torch.bfloat16)
    x64, w164, w264 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    _assert_no_worse(_grads(gelu_mlp, x, w1, w2, gy), _grads(unfused, x, w1, w2, gy),
                     _grads(unfused, x64, w164, w264, gy.double()))


@pytest.mark.gpu
def test_quack_expert_kernels_match_torch_on_gpu():
    """QuACK's variable-length grouped GEMMs at moe-gpt2-125m's expert shapes (768 -> 3,072 -> 768), bf16, with
    uneven groups, one not a multiple of the tile and one empty: outputs and gradients against per-expert
    bf16 matmuls, both measured against fp64; the empty expert's weight gradients are exactly 0."""
    dev = _quack_device()
    torch.manual_seed(0)
    sizes = [3000, 1, 0, 2048, 4555, 700, 128, 1760]
    x, w1, w2, offsets, gy = _expert_inputs(sizes, 768, 3072, torch.bfloat16, dev)
    loop = lambda a, b, c: experts_unfused(a, b, c, sizes)  # noqa: E731
    ours = _grads(lambda a, b, c: moe_gelu_mlp(a, b, c, offsets), x, w1, w2, gy)
    x64, w164, w264 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    _assert_no_worse(ours, _grads(loop, x, w1, w2, gy), _grads(loop, x64, w164, w264, gy.double()))
    assert not ours[2][2].any() and not ours[3][2].any()
