"""MoE family: the vectorised layer against a slow per-token reference, losses, capacity, FLOPs, CLI."""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli

from trainbox.config import load_config
from trainbox.model.build import build_model
from trainbox.model.moe.config import MoESection
from trainbox.model.moe.model import MoEFFN


def reference_moe(m: MoEFFN, x: torch.Tensor):
    """Obviously correct MoE: one token and one choice at a time, GShard priority, explicit capacity."""
    E, k, cf = m.moe.num_experts, m.moe.top_k, m.moe.capacity_factor
    B, T, C = x.shape
    xf = x.reshape(-1, C)
    N = xf.size(0)
    logits = xf @ m.router.weight.t()
    probs = logits.softmax(-1)
    top_p, top_e = probs.topk(k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
    capacity = int(cf * k * N / E) if cf > 0 else math.inf
    used = [0] * E
    rows = [torch.zeros(C) for _ in range(N)]
    kept = 0
    for j in range(k):              # every token's first choice before any second choice
        for n in range(N):          # earlier tokens first
            e = int(top_e[n, j])
            if used[e] >= capacity:
                continue
            used[e] += 1
            kept += 1
            h = F.gelu(xf[n] @ m.c_fc.weight[e] + m.c_fc.bias[e], approximate="tanh")
            rows[n] = rows[n] + gates[n, j] * (h @ m.c_proj.weight[e] + m.c_proj.bias[e])
    counts = torch.bincount(top_e.flatten(), minlength=E)
    balance = E / (N * k) * (counts.float() * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return torch.stack(rows).view(B, T, C), balance, z, counts, 1 - kept / (N * k)


def _layer(cf: float, k: int = 2, E: int = 4, C: int = 32) -> MoEFFN:
    torch.manual_seed(0)
    m = MoEFFN(C, MoESection(num_experts=E, top_k=k, capacity_factor=cf), bias=True, dropout=0.0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m.train()


def _run(fn, m: MoEFFN, x: torch.Tensor, probe: torch.Tensor):
    """Outputs and gradients (x and every parameter) of one scalar built from the layer's results."""
    m.zero_grad()
    x = x.clone().requires_grad_()
    y, balance, z, counts, dropped = fn(m, x)
    (y * probe).sum().add(0.3 * balance + 0.2 * z).backward()
    grads = [x.grad] + [p.grad.clone() for p in m.parameters()]
    return y.detach(), balance.detach(), z.detach(), counts, float(dropped), grads


def _fast(m: MoEFFN, x: torch.Tensor):
    y = m(x)
    a = m.aux
    return y, a["balance"], a["z"], a["tokens_per_expert"], a["dropped"]


@pytest.mark.parametrize("cf,k,use_kernel", [(0.0, 2, True), (0.0, 2, False), (0.75, 2, True),
                                              (0.75, 2, False), (1.0, 1, True), (0.0, 3, True)])
def test_vectorised_layer_matches_reference(cf, k, use_kernel):
    m = _layer(cf, k=k)
    m.use_kernel = use_kernel
    x = torch.randn(2, 12, 32)
    probe = torch.randn(2, 12, 32)
    ref = _run(reference_moe, m, x, probe)
    got = _run(_fast, m, x, probe)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2])
    assert got[3].tolist() == ref[3].tolist()
    assert got[4] == pytest.approx(ref[4])
    if cf:
        assert ref[4] > 0.05, "the case with capacity must actually drop assignments"
    for g, r in zip(got[5], ref[5]):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("n_in, n_out", [(16, 24), (24, 16)], ids=["up", "down"])
def test_grouped_linear_backward_matches_autograd(gelu, n_in, n_out):
    """The hand-written backward of the experts' grouped matmul (GELU output saved, its derivative applied to
    dA; dw as a^T g where the input is the narrower side, as (g^T a)^T where it is the wider) against autograd
    through F.gelu and a loop over experts, fp32, an empty expert included."""
    from trainbox.model.moe.experts import grouped_mm
    torch.manual_seed(0)
    sizes = [5, 0, 11, 8]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), n_in, requires_grad=True)
    w = torch.randn(len(sizes), n_in, n_out, requires_grad=True)
    g = torch.randn(sum(sizes), n_out)
    out = grouped_mm(x, w, offsets, gelu=gelu)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    a = F.gelu(x, approximate="tanh") if gelu else x
    bounds = [0, *offsets.tolist()]
    ref = torch.cat([a[bounds[e]:bounds[e + 1]] @ w[e] for e in range(len(sizes))])
    rdx, rdw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, rdx)
    torch.testing.assert_close(dw, rdw)
    assert dw[1].abs().max() == 0  # the empty expert gets no gradient


def test_dropped_tokens_pass_through_the_residual_unchanged():
    m = _layer(cf=0.01)  # capacity int(0.01 * 2 * 24 / 4) = 0: every assignment is dropped
    y = m(torch.randn(2, 12, 32))
    assert torch.equal(y, torch.zeros_like(y)) and float(m.aux["dropped"]) == 1.0
    m.eval()  # evaluation and generation are dropless
    assert m(torch.randn(2, 12, 32)).abs().sum() > 0 and float(m.aux["dropped"]) == 0.0


def test_jitter_perturbs_routing_in_training_only():
    m = _layer(cf=0.0)
    m.moe = MoESection(num_experts=4, top_k=2, jitter_eps=0.5)
    x = torch.randn(2, 12, 32)
    assert not torch.equal(m(x), m(x))  # fresh multiplicative noise on the router input each call
    m.eval()
    torch.testing.assert_close(m(x), reference_moe(m, x)[0], atol=1e-5, rtol=1e-5)


def test_balance_loss_is_one_at_perfect_balance_and_grows_with_imbalance():
    m = _layer(cf=0.0, k=1, E=4)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, :4] = 20 * torch.eye(4)  # token one-hot in dim e -> expert e, prob ~1
    x = torch.zeros(1, 8, 32)
    x[0, torch.arange(8), torch.arange(8) % 4] = 1.0  # two tokens per expert
    m(x)
    assert float(m.aux["balance"].detach()) == pytest.approx(1.0, abs=1e-6)
    x[0, :, :4] = 0
    x[0, :, 0] = 1.0  # every token to expert 0
    m(x)
    assert float(m.aux["balance"].detach()) == pytest.approx(4.0, abs=1e-4)


def _moe_cfg(*extra: str):
    return load_config("tiny", ["model.family=moe", "model.n_layer=3", "model.n_head=2", "model.n_embd=32",
                                "model.moe.num_experts=4", "model.moe.top_k=2", *extra])


def test_model_aux_loss_stats_and_every():
    cfg = _moe_cfg("model.moe.every=2", "model.moe.lb_loss_weight=0.05", "model.moe.z_loss_weight=0.001")
    torch.manual_seed(0)
    model = build_model(cfg.model, 64, 16)
    assert [i for i, _ in model.moe_layers] == [0, 2]  # Megatron's moe_layer_freq: i % every == 0
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    out = model(x, y)
    layers = [m for _, m in model.moe_layers]
    balance = sum(float(m.aux["balance"].detach()) for m in layers) / 2
    z = sum(float(m.aux["z"].detach()) for m in layers) / 2
    assert float(out.aux_loss.detach()) == pytest.approx(0.05 * balance + 0.001 * z, rel=1e-5)
    assert out.stats["moe.2.tokens_per_expert"].sum() == 2 * 32  # top-2 of 32 tokens
    assert set(out.stats) >= {"moe.0.balance_loss", "moe.0.dropped_frac", "moe_balance_loss"}


def test_cli_train_logs_moe_stats_and_generates(tiny, tmp_path):
    run_cli("train", *tiny, "model.family=moe", "model.moe.num_experts=4", "model.moe.capacity_factor=1.25",
            "train.max_steps=3", "train.eval_every=0", "run.name=moe", "train.peak_tflops=1")
    run = tmp_path / "runs" / "moe"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("event") == "train" and "mfu" in r][-1]
    assert len(last["moe.0.tokens_per_expert"]) == 4 and 0 <= last["moe.1.dropped_frac"] < 1
    assert last["mfu"] == pytest.approx(last["tokens_per_s"] * _flops(run) / 1e12, rel=1e-6)
    out = run_cli("generate", str(run), "--prompt", "ROMEO:", "--max-tokens", "8", "--seed", "1")
    assert out.stdout.startswith("ROMEO:") and len(out.stdout) > len("ROMEO:")
    # no Hugging Face class to export to: the family's own folder, read back by its documented loader
    out = run_cli("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert "trainbox.model.moe.hf.from_pretrained" in out.stdout
    from trainbox.model.load import load_for_inference
    from trainbox.model.moe.hf import from_pretrained
    exported, trained = from_pretrained(tmp_path / "hf"), load_for_inference(run)[0].eval()
    idx = torch.randint(0, 100, (2, 16))
    assert torch.equal(exported(idx).logits, trained(idx).logits)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def _flops(run) -> float:
    import yaml

    from trainbox.config import build_config
    cfg = build_config(yaml.safe_load((run / "config.yaml").read_text()))
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.model.build import pad_vocab
    vocab = cfg.model.vocab_size or pad_vocab(get_tokenizer(cfg.data.tokenizer).vocab_size)
    return build_model(cfg.model, vocab, cfg.data.seq_len).flops_per_token(cfg.data.seq_len)


def test_recipe_and_moe_overrides_validate():
    cfg = load_config("moe-gpt2-125m", ["model.moe.num_experts=128", "model.moe.capacity_factor=2",
                                        "model.moe.top_k=2", "model.moe.lb_loss_weight=0.05",
                                        "train.micro_batch_size=16"])
    assert (cfg.model.family, cfg.model.n_layer, cfg.model.n_embd, cfg.model.vocab_size) == ("moe", 12, 768, 50304)
    base = load_config("moe-gpt2-125m").model.moe
    assert (base.num_experts, base.top_k, base.capacity_factor) == (8, 2, 0.0)


def test_layer_traces_as_one_graph_in_bf16():
    """torch.compile(fullgraph=True) under bf16 autocast: grouped matmuls, no host syncs, same result."""
    m = _layer(cf=1.0)
    x = torch.randn(2, 12, 32)
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = m(x)
        got = compiled(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert m.aux["tokens_per_expert"].sum() == 2 * 24


def test_the_experts_elementwise_work_runs_as_opaque_ops_where_the_split_sizes_stay_in_the_graph(monkeypatch):
    """kernels/rows.py: with OPAQUE (set where the split sizes stay in the compiled graph) the regrouping gather, the
    experts' GELU and its derivative reach the compiled graphs as trainbox's custom ops, which Inductor leaves to
    ATen's kernels, forward and backward; without it, as aten ops Inductor writes kernels for. The values and
    gradients are the same either way."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from trainbox.kernels import rows
    from trainbox.model.moe.experts import _GroupedMM
    from trainbox.parallel.expert import _Permute

    def experts(x, perm, inverse, w, offsets):
        return _GroupedMM.apply(_Permute.apply(x, perm, inverse), w, offsets, True)

    torch.manual_seed(0)
    x, w = torch.randn(12, 8, requires_grad=True), torch.randn(2, 8, 4, requires_grad=True)
    perm = torch.randperm(12)
    inverse, offsets = torch.argsort(perm), torch.tensor([5, 12], dtype=torch.int32)
    groups = [(0, 5), (5, 12)]   # offsets' groups, as Python ints: no read of them in the traced loop

    def loop(a, b, offs):   # the grouped matmul as a loop over groups (CPU builds may lack the kernel in fp32)
        if b.dim() == 3:    # rows of a in groups, times b[e]
            return torch.cat([a[lo:hi] @ b[e] for e, (lo, hi) in enumerate(groups)])
        return torch.stack([a[:, lo:hi] @ b[lo:hi] for lo, hi in groups])   # the weights' gradients, by group

    monkeypatch.setattr("trainbox.model.moe.experts._GROUPED_MM", loop)
    results = {}
    for opaque in (False, True):
        monkeypatch.setattr(rows, "OPAQUE", opaque)
        graphs = {"forward": [], "backward": []}

        def keep(kind, gm, _, graphs=graphs):
            graphs[kind].append(str(gm.graph))
            return make_boxed_func(gm)

        capture = aot_autograd(fw_compiler=functools.partial(keep, "forward"),
                               bw_compiler=functools.partial(keep, "backward"))
        torch._dynamo.reset()
        y = torch.compile(experts, backend=capture)(x, perm, inverse, w, offsets)
        gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
        results[opaque] = (y.detach(), gx, gw)
        forward, backward = "".join(graphs["forward"]), "".join(graphs["backward"])
        assert ("trainbox.take_rows" in forward and "trainbox.gelu_tanh" in forward
                and "trainbox.gelu_tanh_backward" in backward) == opaque, graphs
        assert ("aten.gelu_backward" in backward) != opaque and ("aten.gelu." in forward) != opaque, graphs
    torch._dynamo.reset()
    for plain, opaque in zip(results[False], results[True]):
        torch.testing.assert_close(opaque, plain, rtol=0, atol=0)
    ref = torch.cat([F.gelu(x[perm][lo:hi], approximate="tanh") @ w[e] for e, (lo, hi) in enumerate(groups)])
    torch.testing.assert_close(results[True][0], ref.detach())
