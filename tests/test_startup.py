"""What a trainbox process imports at start: a process that builds no optimizer (generate, export, config validate,
the memory check, a --nproc launcher) loads neither Dynamo nor FSDP, DTensor or distributed checkpoints (together
most of a second, with sympy), and loss.png needs no pyplot. The helpers that make this so behave as the torch
decorators they stand for (kernels/ops.py `eager`, `constant_when_traced`)."""
from __future__ import annotations

import torch
from conftest import TINY, run_check_script

from trainbox.kernels.ops import constant_when_traced, eager

LIGHT = r"""
import sys
from pathlib import Path
import torch
from trainbox.config import load_config
from trainbox.model.build import build_model
from trainbox.monitor.plot import write_loss_png
from trainbox.plan import run_vocab
from trainbox.train.memory import check_memory
from trainbox.train.preflight import preflight
import trainbox.cli, trainbox.export, trainbox.generate, trainbox.model.load, trainbox.train.loop  # noqa: F401

root = Path(sys.argv[1])
cfg = preflight(load_config("tiny", OVERRIDES), 1).cfg
vocab = run_vocab(cfg)
plan = check_memory(cfg, vocab, torch.device("cpu"), torch.float32)   # counts the model built on the meta device
model = build_model(cfg.model, vocab, cfg.data.seq_len, run=cfg)
assert plan.counts.total == sum(p.numel() for p in model.parameters()), (plan.counts, model)
idx = torch.randint(0, vocab, (2, 17))
model(idx[:, :-1], idx[:, 1:]).loss.backward()
(root / "metrics.jsonl").write_text('{"event": "train", "step": 1, "tokens": 8, "loss": 2.0}\n')
assert write_loss_png(root).exists()
loaded = [m for m in ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
                      "torch.distributed.checkpoint", "matplotlib.pyplot") if m in sys.modules]
assert not loaded, loaded
print("ok")
"""


def test_a_process_that_builds_no_optimizer_loads_no_dynamo_fsdp_or_pyplot(tmp_path, data_cache):
    overrides = [*TINY, f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={data_cache}"]
    code = LIGHT.replace("OVERRIDES", repr(overrides)).replace("sys.argv[1]", repr(str(tmp_path)))
    run_check_script(code)


def _summed(x: torch.Tensor) -> torch.Tensor:
    return x.float().sum() * 2.0   # traceable: only the decorator keeps it out of the graph


def _compiled_twice(disabled, traced_first: bool):
    """Outputs and the graphs Dynamo made for a function that calls `disabled` between two traced parts."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def f(x):
        y = x.sin()
        return y.cos() + disabled(y > 0)

    torch._dynamo.reset()
    counters.clear()
    x = torch.linspace(-1, 1, 16)
    if not traced_first:
        f(x)
    compiled = torch.compile(f, backend="eager")
    out = [compiled(x * k) for k in (1.0, 2.0, -1.0)]
    return out, counters["stats"]["unique_graphs"]


def test_eager_is_torch_compiler_disable_under_compile():
    """The same outputs and the same graphs on each side of the call, whether the first call is traced or eager."""
    for traced_first in (True, False):
        want, graphs = _compiled_twice(torch.compiler.disable(_summed), traced_first)
        got, ours = _compiled_twice(eager(_summed), traced_first)
        assert ours == graphs == 2
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_constant_when_traced_marks_as_torch_does():
    def ours():
        return 1

    def theirs():
        return 1

    assert constant_when_traced(ours) is ours
    assert vars(ours) == vars(torch.compiler.assume_constant_result(theirs)) != {}
