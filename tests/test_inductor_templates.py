"""benchmarks/common.py's inductor_templates, the experiment switch behind train_speed.py's and profile_step.py's
--templates: after a compile in the same process (a baseline run), the next compile lowers the chosen matmuls
through it, and only those, and computes what eager computes; restoring it leaves Inductor's lowerings as they were."""
from __future__ import annotations

import torch
from conftest import load_benchmark


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """A GELU MLP of width 96 beside a matmul of other widths (an attention projection's stand-in)."""
    h = torch.nn.functional.gelu(x @ w1, approximate="tanh") @ w2
    return h + x @ wq


def test_the_switch_lowers_the_chosen_matmuls_after_a_baseline_compile(capfd):
    common = load_benchmark("common")
    from torch._inductor import lowering
    mm = torch.ops.aten.mm.default
    before = lowering.lowerings[mm]
    x, w1, w2, wq = torch.randn(8, 32), torch.randn(32, 96), torch.randn(96, 32), torch.randn(32, 32)
    torch.compile(mlp)(x, w1, w2, wq)            # the baseline's compile, before the switch
    capfd.readouterr()
    # a CPU has no Triton template: ATen is the choice
    restore = common.inductor_templates("mlp", "ATEN,TRITON", width=96)
    try:
        got = torch.compile(mlp)(x, w1, w2, wq)
        err = capfd.readouterr().err
    finally:
        restore()
    # the two matmuls with a dimension of 96 went through the switch, the 32 x 32 one did not
    assert err.count("templates: autotuning aten.mm.default over ATEN,TRITON") == 2, err
    torch.testing.assert_close(got, mlp(x, w1, w2, wq), rtol=1e-5, atol=1e-5)
    assert lowering.lowerings[mm] is before
