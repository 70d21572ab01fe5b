"""FP8 head (kernels/fp8.py): the arithmetic against the fp32 product, dynamic scaling, the fallback, one
compiled graph, the speedrun wiring, and the clear refusal where no FP8 tensor cores exist."""
from __future__ import annotations

import pytest
import torch
from conftest import model_section

from trainbox.config import load_config
from trainbox.errors import ConfigError
from trainbox.kernels.fp8 import fp8_linear
from trainbox.model.build import build_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def products(x, w, g, fn):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.float().backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("scale", [1.0, 1e4, 1e-4])
def test_forward_and_gradients_match_fp32_within_fp8_error(scale):
    """e4m3 has 3 mantissa bits and e5m2 2, so single values are off by up to ~6% / ~12%; matmul sums
    average that down. The error must also be clearly non-zero (the product really went through FP8),
    and dynamic scaling must keep it the same when the operands are scaled by 1e4 or 1e-4 (fixed scales
    would overflow e4m3's 448 or flush to zero)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * scale
    w = torch.randn(96, 128, generator=g) / scale
    dy = torch.randn(64, 96, generator=g)
    y8, dx8, dw8 = products(x, w, dy, fp8_linear)
    y, dx, dw = products(x, w, dy, lambda a, b: a @ b.t())
    assert y8.dtype == torch.bfloat16 and dx8.dtype == x.dtype and dw8.dtype == w.dtype
    for got, want, bound in ((y8, y, 0.06), (dx8, dx, 0.12), (dw8, dw, 0.12)):
        assert 1e-3 < rel(got, want) < bound


def test_rows_not_a_multiple_of_16_use_the_exact_matmul():
    x, w = torch.randn(3, 7, 32), torch.randn(48, 32)
    torch.testing.assert_close(fp8_linear(x, w), x @ w.t())


def test_traces_as_one_graph():
    """An autograd.Function of plain ops: no graph break under compile, and the same gradients as eager."""
    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(80, 64, requires_grad=True)
    compiled = torch.compile(lambda a, b: fp8_linear(a, b).float().square().mean(), backend="aot_eager", fullgraph=True)
    loss = compiled(x, w)
    loss.backward()
    ref_x, ref_w = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fp8_linear(x, w).float().square().mean().backward()
    torch.testing.assert_close(x.grad, ref_x)
    torch.testing.assert_close(w.grad, ref_w)


@pytest.mark.parametrize("family", ["speedrun", "gpt"])
def test_head_in_fp8_tracks_the_bf16_head(family):
    def model(fp8: bool):
        torch.manual_seed(0)
        m = build_model(model_section(family, n_layer=2, n_head=2, n_embd=64, head_dim=32, window=32,
                                     eot_id=0, fp8_head=fp8), 128, 32)
        with torch.no_grad():
            m.lm_head.weight.normal_(std=0.3)  # zero at init: make the head matter
        return m

    idx = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(1))  # 2 x 32 rows: the FP8 path
    losses, grads = [], []
    for fp8 in (True, False):
        m = model(fp8)
        loss = m(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(m.lm_head.weight.grad)
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 0.02 * losses[1]
    assert rel(grads[0], grads[1]) < 0.15


@pytest.mark.parametrize("family", ["speedrun", "gpt"])
@pytest.mark.parametrize("mode", ["down", "both"])
def test_mlp_in_fp8_tracks_the_exact_mlp(family, mode):
    """model.fp8_mlp: the projections really go through FP8 (loss and gradients differ from the exact
    model) and stay within FP8's error of it (gpt: with the projections' biases)."""
    def run(fp8_mlp: str):
        torch.manual_seed(0)
        m = build_model(model_section(family, n_layer=2, n_head=2, n_embd=64, head_dim=32, window=32,
                                     eot_id=0, fp8_mlp=fp8_mlp), 128, 32)
        blocks = m.blocks if family == "speedrun" else m.transformer.h
        with torch.no_grad():
            m.lm_head.weight.normal_(std=0.3)
            for b in blocks:
                b.mlp.c_proj.weight.normal_(std=0.1)  # zero at init in speedrun: make the MLP matter
        idx = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(1))
        loss = m(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()).loss
        loss.backward()
        return loss.item(), blocks[0].mlp.c_fc.weight.grad, blocks[0].mlp.c_proj.weight.grad

    (l8, fc8, proj8), (l, fc, proj) = run(mode), run("none")
    assert l8 != l and abs(l8 - l) < 0.02 * l
    assert 1e-3 < rel(proj8, proj) < 0.15 and 1e-3 < rel(fc8, fc) < 0.15


def test_fp8_mlp_is_refused_without_fp8_tensor_cores(tiny):
    from trainbox.train.loop import Trainer

    with pytest.raises(ConfigError, match="model.fp8_mlp applies to model.family=gpt or speedrun, not moe"):
        load_config(None, [*tiny, "model.family=moe", "model.fp8_mlp=down"])
    with pytest.raises(ConfigError, match="model.fp8_mlp"):
        load_config(None, [*tiny, "model.family=speedrun", "model.head_dim=16", "model.fp8_mlp=up"])
    cfg = load_config(None, [*tiny, "model.family=speedrun", "model.head_dim=16", "model.fp8_mlp=both",
                             "model.fp8_head=true", "train.device=cpu"])
    with pytest.raises(ConfigError, match=r"model.fp8_head=true and model.fp8_mlp=both needs a GPU with FP8") as err:
        Trainer(cfg)
    assert "drop model.fp8_head and model.fp8_mlp" in err.value.hint


def test_fp8_head_is_refused_without_fp8_tensor_cores(tiny):
    from trainbox.train.loop import Trainer

    with pytest.raises(ConfigError, match="model.fp8_head applies to model.family=gpt or speedrun, not moe"):
        load_config(None, [*tiny, "model.family=moe", "model.fp8_head=true"])
    cfg = load_config(None, [*tiny, "model.family=speedrun", "model.head_dim=16", "model.fp8_head=true",
                             "train.device=cpu"])
    with pytest.raises(ConfigError, match=r"model.fp8_head=true needs a GPU with FP8 tensor cores .* on cpu") as err:
        Trainer(cfg)
    assert "drop model.fp8_head" in err.value.hint and "model.fp8_fallback=true" in err.value.hint


def test_fp8_recipe_falls_back_to_plain_matmuls_without_fp8(caplog):
    """speedrun-124m asks for FP8 where the device has it (model.fp8_fallback): on a CPU the run goes ahead
    with the FP8 options off in the resolved config, and says so once; the model then has no FP8 path left."""
    from trainbox.kernels.fp8 import fp8_supported
    from trainbox.train.loop import Trainer

    cfg = load_config("speedrun-124m", ["train.device=cpu"])
    assert cfg.model.fp8_fallback and cfg.model.fp8_options
    if torch.cuda.is_available() and fp8_supported(torch.device("cuda")):
        pytest.skip("this machine has FP8 tensor cores")
    with caplog.at_level("WARNING", logger="trainbox"):
        resolved = Trainer(cfg).cfg
    assert not resolved.model.fp8_head and resolved.model.fp8_mlp == "none" and resolved.model.fp8_options == []
    assert cfg.model.fp8_head and cfg.model.fp8_options, "the config the user gave is never changed"
    warned = [r.getMessage() for r in caplog.records if "model.fp8_fallback" in r.getMessage()]
    assert len(warned) == 1 and "has no FP8 tensor cores, so these matmuls run in float32" in warned[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("k,n", [(768, 50304), (768, 3072), (3072, 768)], ids=["head", "mlp_up", "mlp_down"])
def test_on_the_gpu_compiled_with_inductor(k, n):
    """The FP8 kernels themselves (cuBLASLt through _scaled_mm) at the head's and the MLP's real shapes, compiled."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    dy = torch.randn(4096, n, device="cuda", generator=g)
    y8, dx8, dw8 = products(x, w, dy, torch.compile(fp8_linear, fullgraph=True))
    y, dx, dw = products(x.float(), w, dy, lambda a, b: a @ b.t())
    for got, want, bound in ((y8, y, 0.06), (dx8, dx, 0.12), (dw8, dw, 0.12)):
        assert 1e-3 < rel(got, want) < bound
