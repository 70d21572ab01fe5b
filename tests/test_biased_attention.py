"""kernels/biased_attention.py: attention with a learned bias shared by the batch (T5's self-attention). The op
against SDPA with the bias as an additive mask (outputs and the gradients of q, k, v and the bias), the Triton
kernels in the interpreter (CPU) and on the GPU, T5 on the op against T5 on SDPA, and where the kernel is chosen."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import run_in_triton_interpreter

from trainbox.config import ModelSection
from trainbox.errors import ConfigError
from trainbox.kernels import biased_attention as ba
from trainbox.kernels.choice import choose
from trainbox.model.spec import family
from trainbox.model.t5.model import T5

CASES = [(3, 37, 37, 2, 16, True), (2, 20, 70, 3, 16, False), (2, 70, 70, 2, 32, False),  # B, Tq, Tk, H, D, causal
         (2, 19, 19, 2, 24, True), (2, 64, 64, 2, 16, True)]   # the last: whole blocks, no masks


def sdpa_reference(q, k, v, bias, scale, causal):
    """SDPA (math) on (B, T, H, D) tensors with the bias (H, Tq, Tk) broadcast over the batch as an additive mask."""
    mask = bias.unsqueeze(0)
    if causal:
        mask = mask + torch.full(bias.shape[-2:], float("-inf"), device=bias.device).triu(1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale)
    return o.transpose(1, 2)


def inputs(B, Tq, Tk, H, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, device=device).to(dtype) for T in (Tq, Tk, Tk))
    return q, k, v, torch.randn(H, Tq, Tk, generator=g, device=device)


def grads(fn, q, k, v, bias, do):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    out = fn(*leaves)
    out.backward(do)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("case", CASES)
def test_op_equals_sdpa_with_the_bias_as_a_mask(case):
    """The op (its torch path on a CPU) through autograd: output and all four gradients, the bias's summed over the
    batch, equal SDPA's within fp32 rounding; causal, cross (Tq != Tk) and wider heads."""
    *shape, causal = case
    q, k, v, bias = inputs(*shape)
    do = torch.randn(q.shape)
    got, got_g = grads(lambda *t: ba.biased_attention(*t, scale=0.7, causal=causal), q, k, v, bias, do)
    want, want_g = grads(lambda *t: sdpa_reference(*t, 0.7, causal), q, k, v, bias, do)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("case", CASES)
def test_a_bias_by_distance_equals_its_diagonals_by_position(case):
    """The bias given by distance (H, Tq + Tk - 1), as T5 passes it: the output and the gradients of q, k, v equal
    the op's on the same bias laid out by position, and its gradient is that one's summed along each diagonal."""
    *shape, causal = case
    q, k, v, _ = inputs(*shape)
    B, Tq, Tk, H, D = shape
    rel = torch.randn(H, Tq + Tk - 1)
    do = torch.randn(q.shape)
    got, got_g = grads(lambda *t: ba.biased_attention(*t, scale=0.7, causal=causal), q, k, v, rel, do)
    want, want_g = grads(lambda *t: ba.biased_attention(*t[:3], ba.diagonals(t[3], Tq, Tk), scale=0.7, causal=causal),
                         q, k, v, rel, do)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_frozen_bias_gets_no_gradient_and_the_rest_theirs():
    q, k, v, bias = inputs(2, 20, 20, 2, 8)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    do = torch.randn(q.shape)
    ba.biased_attention(*leaves, bias, causal=True).backward(do)
    _, want = grads(lambda *t: sdpa_reference(*t, 1.0, True), q, k, v, bias, do)
    assert bias.grad is None
    for t, w in zip(leaves, want):
        torch.testing.assert_close(t.grad, w, rtol=1e-4, atol=5e-5)


def test_op_compiles_in_one_graph():
    """torch.compile traces through the op (its fake shapes) with no graph break, forward and backward, once it is
    defined (ops(): T5.set_kernels defines it before the loop compiles)."""
    ba.ops()
    q, k, v, bias = inputs(2, 24, 24, 2, 8)
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    fn = torch.compile(lambda *t: ba.biased_attention(*t, causal=True).square().sum(), backend="aot_eager",
                       fullgraph=True)
    fn(*leaves).backward()
    _, want = grads(lambda *t: sdpa_reference(*t, 1.0, True), q, k, v, bias,
                    2 * sdpa_reference(q, k, v, bias, 1.0, True).detach())
    for t, w in zip(leaves, want):
        torch.testing.assert_close(t.grad, w, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_refused_with_the_shapes():
    q, k, v, bias = inputs(2, 10, 12, 2, 8)
    with pytest.raises(ValueError, match=r"bias \(2, 10, 10\) is neither \(heads, Tq, Tk\) = \(2, 10, 12\) nor "
                                         r"\(heads, Tq \+ Tk - 1\) = \(2, 21\)"):
        ba.biased_attention(q, k, v, bias[..., :10])
    with pytest.raises(ValueError, match="causal attention needs as many queries as keys"):
        ba.biased_attention(q, k, v, bias, causal=True)


SHAPE = dict(family="t5", n_layer=2, n_head=4, n_embd=32,
             t5=dict(d_ff=48, d_kv=8, num_decoder_layers=3, relative_attention_num_buckets=8,
                     relative_attention_max_distance=20))


def t5_loss_and_grads(kernel: str, device="cpu", dtype=None):
    torch.manual_seed(0)
    model = T5(ModelSection(**SHAPE), 160, 64).to(device)
    model.set_kernels(torch.device(device))
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            block.layer[0].SelfAttention.kernel = kernel
    g = torch.Generator(device=device).manual_seed(1)
    x, y = torch.randint(0, 160, (3, 45), generator=g, device=device), torch.randint(0, 160, (3, 17), generator=g,
                                                                                   device=device)
    with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(x, y).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_t5_on_the_op_equals_t5_on_sdpa():
    """T5 with its self-attention on the op (encoder, and the decoder's causal) against the SDPA path: the loss and
    every gradient, the position-bias tables' included."""
    loss, g = t5_loss_and_grads("triton")
    want_loss, want = t5_loss_and_grads("sdpa")
    assert abs(loss - want_loss) < 1e-5
    assert g["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].abs().sum() > 0
    for name in want:
        torch.testing.assert_close(g[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_kernel_is_chosen_where_it_runs():
    """auto takes the kernels on a CUDA GPU (the faster t5-base step on an H200) and sdpa on a CPU, which refuses
    model.attention=triton, saying why; other families do not take them."""
    t5 = family("t5")
    assert choose(ModelSection(**SHAPE), torch.device("cpu"), t5).attention == "sdpa"
    with pytest.raises(ConfigError, match="model.attention=triton runs trainbox's Triton kernels"):
        choose(ModelSection(**SHAPE, attention="triton"), torch.device("cpu"), t5)
    with pytest.raises(ValueError, match="model.attention=triton applies to model.family=t5"):
        ModelSection(family="gpt", attention="triton")


KERNEL_CHECK = r"""
import torch
from trainbox.kernels import biased_attention as ba

torch.manual_seed(0)
# fp32 only: the interpreter's bf16 dot is not the GPU's
for B, Tq, Tk, H, D, causal in CASES:
    q, k, v = (torch.randn(B, T, H, D) for T in (Tq, Tk, Tk))
    bias, do = torch.randn(H, Tq, Tk), torch.randn(B, Tq, H, D)
    # blocks of 16 queries and 16 keys, 32 x 16 for the bias gradient's tiles
    blocks = {name: (32 if name == "dbias" else 16, 16, 4, 1) for name in ba.BLOCKS}
    o, lse = ba._triton_forward(q, k, v, bias, 0.7, causal, blocks)
    ro, rlse = ba._forward_reference(q, k, v, bias, 0.7, causal)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    got = ba._triton_backward(do, q, k, v, bias, o, lse, 0.7, causal, blocks)
    for a, r in zip(got, ba._backward_reference(do, q, k, v, bias, o, lse, 0.7, causal)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=2e-5)
    assert ba._triton_backward(do, q, k, v, bias, o, lse, 0.7, causal, blocks, bias_grad=False)[3] is None
    # the bias by distance, read along its diagonals (row stride -1)
    rel = torch.randn(H, Tq + Tk - 1)
    o, lse = ba._triton_forward(q, k, v, rel, 0.7, causal, blocks)
    ro, rlse = ba._forward_reference(q, k, v, ba.diagonals(rel, Tq, Tk), 0.7, causal)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    got = ba._triton_backward(do, q, k, v, rel, o, lse, 0.7, causal, blocks)
    for a, r in zip(got, ba._backward_reference(do, q, k, v, rel, o, lse, 0.7, causal)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=5e-5)
print("ok")
""".replace("CASES", repr(CASES))


def test_triton_kernels_in_the_interpreter():
    """The Triton kernels on CPU (TRITON_INTERPRET=1), against the torch path: blocks that cross Tq and Tk, the
    causal skip of key and query blocks and of the bias gradient's tiles, whole blocks without masks."""
    run_in_triton_interpreter(KERNEL_CHECK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("by", ["position", "distance"])
@pytest.mark.parametrize("shape", [(32, 512, 512, 12, 64, False), (32, 114, 114, 12, 64, True)])
def test_cuda_kernels_at_t5_base_shapes(shape, by):
    """t5-base's encoder and decoder self-attention in bf16: the CUDA kernels against the fp32 torch path on the same
    bf16 inputs, within bf16 rounding of each output's scale; the bias by position and by distance (T5's)."""
    *dims, causal = shape
    q, k, v, bias = inputs(*dims, dtype=torch.bfloat16, device="cuda")
    if by == "distance":
        bias = torch.randn(dims[3], dims[1] + dims[2] - 1, device="cuda")
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)
    o, lse = ba._triton_forward(q, k, v, bias, 1.0, causal)
    ro, rlse = ba._forward_reference(q.float(), k.float(), v.float(), bias, 1.0, causal)
    assert (o.float() - ro).abs().max() <= 2 ** -7 * ro.abs().max()
    torch.testing.assert_close(lse, rlse, rtol=1e-3, atol=1e-3)
    got = ba._triton_backward(do, q, k, v, bias, o, lse, 1.0, causal)
    want = ba._backward_reference(do.float(), q.float(), k.float(), v.float(), bias, o.float(), lse, 1.0, causal)
    for name, a, r in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert (a.float() - r).abs().max() <= 2 ** -6 * r.abs().max(), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_t5_on_the_kernel_equals_t5_on_sdpa_in_bf16():
    """T5 in bf16 on the GPU, on the kernels (model.attention=auto or triton): the loss within bf16 noise of
    the SDPA path's, the position-bias gradient within 2% of its scale."""
    cuda, t5 = torch.device("cuda"), family("t5")
    assert choose(ModelSection(**SHAPE), cuda, t5).attention == "triton"
    assert choose(ModelSection(**SHAPE, attention="sdpa"), cuda, t5).attention == "sdpa"
    loss, g = t5_loss_and_grads("triton", "cuda", torch.bfloat16)
    want_loss, want = t5_loss_and_grads("sdpa", "cuda", torch.bfloat16)
    assert abs(loss - want_loss) < 1e-2 * want_loss
    for stack in ("encoder", "decoder"):
        name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        assert (g[name] - want[name]).abs().max() <= 0.02 * want[name].abs().max(), name
