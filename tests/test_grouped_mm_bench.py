"""benchmarks/grouped_mm_rates.py times the experts' own matmuls: on a CPU, its grouped forward and weight gradient
equal a loop of plain matmuls over the experts, and its rows split unevenly as it says."""
from __future__ import annotations

import pytest
from conftest import load_benchmark


def test_the_timed_grouped_matmuls_are_the_experts_matmuls():
    bench = load_benchmark("grouped_mm_rates")
    sizes = bench.uneven_sizes(400, 4)
    assert sum(sizes) == 400 and len(set(sizes)) > 1 and all(0.75 * 100 <= s <= 1.25 * 100 for s in sizes)
    r = bench.linear_rates(sizes, 16, 32, iters=1, device="cpu")
    assert r["loop_fwd_maxdiff"] < 1e-2 and r["loop_dw_maxdiff"] < 1e-2
    for op in ("aten_fwd", "aten_dx", "aten_dw", "loop_fwd", "loop_dw", "dense_mm"):
        tflops = 2 * 400 * 16 * 32 / (r[f"{op}_ms"] * 1e-3) / 1e12
        assert r[f"{op}_ms"] > 0 and r[f"{op}_tflops"] == pytest.approx(tflops, rel=0.01, abs=1e-3)
    assert not any(k.startswith("triton_") for k in r)   # the Triton template is a GPU's
