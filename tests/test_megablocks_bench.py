"""benchmarks/megablocks_speed.py hands MegaBlocks our weights in its layout: on a CPU, MegaBlocks' dMoE arithmetic
written out in torch (softmax router, top-k, weights renormalised by their 1-norm, GELU(x @ w1[e].T) @ w2[e] with
w1 and w2 viewed (E, 4d, d)) over those weights gives our layer's output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import load_benchmark


def _megablocks_arithmetic(x, router, w1, w2, top_k):
    E, d = router.shape
    w1, w2 = w1.view(E, -1, d), w2.view(E, -1, d)
    weights, experts = torch.topk((x @ router.t()).softmax(-1), top_k, dim=-1)
    weights = weights / weights.norm(p=1, dim=-1, keepdim=True)
    y = torch.zeros_like(x)
    for j in range(top_k):
        for e in range(E):
            rows = experts[:, j] == e
            h = F.gelu(x[rows] @ w1[e].t(), approximate="tanh") @ w2[e]
            y[rows] += weights[rows, j, None] * h
    return y


def test_megablocks_layout_computes_our_layer():
    bench = load_benchmark("megablocks_speed")
    torch.manual_seed(0)
    layer = bench.ours(32, 4, 2, torch.device("cpu"))
    x = torch.randn(96, 32)
    with torch.no_grad():
        ours = layer(x.view(1, -1, 32)).view(-1, 32)
        theirs = _megablocks_arithmetic(x, *bench.megablocks_weights(layer), top_k=2)
    assert ours.abs().max() > 1e-3   # the experts' weights are set (std 0.02), not left as allocated
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
