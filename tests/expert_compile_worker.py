"""One rank of tests/test_expert_parallel.py's compiled launch (gloo, CPU, bf16 autocast). Not collected by pytest.

The model of a run with expert parallelism 2 and the uneven exchange (the dense part's strategy, activation
checkpointing and capacity factor from the command line), built by the trainer's own path (train/build.py) with
train.compile on and off from the same seed: the compiled forward (DDP's, or FSDP's blocks)
breaks at no data-dependent operator, the split sizes' host read included (parallel/__init__.py:
split_sizes_in_graph), and its loss and every gradient equal the uncompiled model's within bf16's rounding.

Each argument is one configuration, "PARALLEL,CHECKPOINTING,CAPACITY", checked in turn in one launch (Dynamo reset
between them, so each compiles from nothing as in a process of its own): rank 0 prints "ok CONFIG" for each that
passes. The first that fails ends the launch with its assertion, leaving the configurations after it unchecked.
"""
from __future__ import annotations

import os
import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from trainbox.config import load_config
from trainbox.config.layout import decide_layout
from trainbox.parallel import split_sizes_in_graph
from trainbox.parallel.distributed import Dist
from trainbox.train.build import build_model_side

VOCAB, B, T = 128, 2, 16


def config(parallel: str, checkpointing: str, capacity: str, compile: bool):
    return load_config("tiny", [
        "model.family=moe", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.moe.num_experts=4",
        "model.moe.top_k=2", f"model.moe.capacity_factor={capacity}", "model.moe.expert_parallel=2",
        "train.device=cpu", f"train.parallel={parallel}", f"train.activation_checkpointing={checkpointing}",
        f"train.compile={str(compile).lower()}", "optim.name=adamw"])


def grads(run, x, y) -> tuple[float, dict]:
    run.model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run.parallel.forward(x, y)
    (out.loss + out.aux_loss).backward()
    return out.loss.item(), {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}


def check(d: Dist, parallel: str, checkpointing: str, capacity: str) -> None:
    g = torch.Generator().manual_seed(d.rank)
    x, y = torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)
    runs = {}
    for compile in (False, True):
        cfg = config(parallel, checkpointing, capacity, compile)
        runs[compile] = build_model_side(cfg, decide_layout(cfg, d.world, "cpu", adapt_micro_batch=True), VOCAB,
                                         torch.device("cpu"), d, init_weights=True)
        runs[compile].model.train()
    counters.clear()
    want_loss, want = grads(runs[False], x, y)
    for _ in range(2):   # the second call runs the graphs the first one compiled
        got_loss, got = grads(runs[True], x, y)
    # DDP's own bookkeeping around the compiled module breaks the outer frame (torch's, not the model's); the
    # model's graph breaks at nothing, its split sizes' host read included
    breaks = [k.splitlines()[0] for k in counters["graph_break"]]
    assert not any("Data dependent" in k or "_local_scalar_dense" in k for k in counters["graph_break"]), breaks
    assert abs(got_loss - want_loss) < 2e-2, (got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), atol=5e-3, rtol=5e-2, msg=name)


def main() -> None:
    torch.set_num_threads(1)
    d = Dist(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]))
    d.init(torch.device("cpu"), 120)
    split_sizes_in_graph()   # as the loop does where model.moe.split_sizes keeps them in the graph
    for spec in sys.argv[1:]:
        torch._dynamo.reset()   # this configuration's graphs compiled from nothing, as in a process of its own
        check(d, *spec.split(","))
        if d.rank == 0:
            print(f"ok {spec}", flush=True)
    d.shutdown()


if __name__ == "__main__":
    main()
