"""model.attention for the gpt family: SDPA everywhere, FlashAttention-4 on the packed qkv where it runs."""
import pytest
import torch

from trainbox.config import ModelSection
from trainbox.errors import ConfigError
from trainbox.model.build import build_model

VOCAB = 96


def make(family: str = "gpt", **kw):
    torch.manual_seed(0)
    cfg = ModelSection(**{"family": family, "n_layer": 2, "n_head": 4, "n_embd": 64, **kw})
    return build_model(cfg, VOCAB, 128)


@pytest.mark.parametrize("family", ["gpt", "moe"])
def test_attention_on_cpu_is_sdpa_and_flash_is_refused(family):
    model = make(family)
    model.set_step(0)
    assert model.backend == "sdpa" and not any(b.attn.flash for b in model.transformer.h)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        make(family, attention="flash").set_step(0)


def test_flex_is_speedrun_only():
    with pytest.raises(ValueError, match="model.attention=flex applies to model.family=speedrun"):
        ModelSection(family="gpt", n_head=2, n_embd=32, attention="flex")


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
def test_flash_matches_sdpa_on_gpu(bias):
    """FlashAttention-4 on the packed qkv against SDPA, compiled, bf16: the loss and every gradient (the
    qkv projection's through the one (B, T, 3, H, D) gradient the kernel writes, its bias included)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trainbox.kernels.flash import flash_available
    if not flash_available(torch.device("cuda")):
        pytest.skip("needs flash-attn-4 and a Hopper or Blackwell GPU")
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (4, 128), generator=g).cuda()
    results = {}
    for attention in ("flash", "sdpa"):
        model = make(n_head=2, n_embd=256, bias=bias, attention=attention).cuda()  # heads of 128
        model.set_step(0)
        assert model.backend == attention
        step = torch.compile(lambda i, t, model=model: model(i, t).loss)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results[attention] = loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}
    (lf, gf), (ls, gs) = results["flash"], results["sdpa"]
    assert abs(lf - ls) < 2e-3 * abs(ls)
    for name, grad in gs.items():
        err = (gf[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert err < 2e-2, (name, err.item())
