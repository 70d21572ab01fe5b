"""Expert parallelism (model.moe.expert_parallel) under real torchrun with gloo on CPU, fp32.

Torchrun launches of tests/expert_parallel_worker.py. The first on 4 and the first on 2 processes check, with
expert_parallel 1, 2 and 4 (those dividing the world size), the dense part under ddp and under fsdp, dropless and
dropping: an MoE layer's output, the hidden states, losses, every gradient, the clipped norm, the weights after an
AdamW step and the checkpoint state gathered to rank 0, against the single-process model and test_moe's slow
per-token reference. Every launch then trains a run, against one uninterrupted process (the same losses at every
step, the same evaluations, the same final weights):
- ep: 2 steps on 4 processes with expert_parallel=4 and the padded exchange, resumed for 2 more on 2 processes
  with expert_parallel=2, the uneven exchange and selective activation checkpointing;
- pad: ep's first 2 steps, resumed for 2 more on 2 processes with expert_parallel=2 and fsdp, the padded exchange
  and full activation checkpointing;
- mixed: the single process's checkpoint of step 2 (one file) resumed on 4 processes with expert_parallel=2 and
  fsdp (each expert shard on 2 ranks) for step 3, then on 2 processes with expert_parallel=2 and ddp for step 4;
- cut: the same checkpoint resumed on 2 processes with expert_parallel=2 and ddp for steps 3 and 4, whose first
  save is sharded.
And the settings expert parallelism refuses, before any work.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_cli
from safetensors.torch import load_file

from trainbox.config import load_config
from trainbox.config.layout import decide_layout
from trainbox.errors import ConfigError
from trainbox.train.loop import train

HERE = Path(__file__).parent
# the final weights of the expert-parallel run against one process's: the same maths up to the order of sums, which
# AdamW amplifies (3.9e-6 measured after these 4 steps at lr 5e-3); tests/test_fsdp.py's WEIGHT_ATOL says why 1e-4
WEIGHT_TOL = dict(atol=1e-4, rtol=0)
MOE = ["optim.name=adamw", "model.family=moe", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.capacity_factor=1.0", "model.moe.lb_loss_weight=0.05", "model.moe.z_loss_weight=0.01"]


def _torchrun(nproc: int, worker: str, *args: str) -> str:
    """A torchrun launch of `worker` (a script beside this file), which prints "ok" on rank 0; returns its log."""
    src = str(HERE.parent / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(HERE / worker), *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stderr


def _launch(nproc: int, run_overrides: list[str], checks: bool = True) -> str:
    """A torchrun launch of the worker: its model-level checks (`checks`), then the run."""
    return _torchrun(nproc, "expert_parallel_worker.py", *([] if checks else ["--no-checks"]), "--train",
                     *run_overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> Path:
    """runs/one: 4 steps on one process; runs/ep, runs/pad and runs/mixed as the docstring says."""
    root = tmp_path_factory.mktemp("expert") / "runs"
    base = [*TINY, f"run.dir={root}", f"data.cache_dir={data_cache}", *MOE, "train.micro_batch_size=2",
            "train.eval_every=2", "train.eval_tokens=320", "train.checkpoint_every=2", "monitor.enabled=false",
            "train.pg_timeout_s=60"]   # 10 validation samples: the ranks hold 3, 3, 2 and 2 of them
    train(load_config(None, [*base, "run.name=one", "train.max_steps=4"]))
    _launch(4, [*base, "run.name=ep", "train.max_steps=2", "model.moe.expert_parallel=4", "model.moe.exchange=padded"])
    shutil.copytree(root / "ep", root / "pad")
    log = _launch(2, [*base, "run.name=ep", "train.max_steps=4", "model.moe.expert_parallel=2",
                      "train.activation_checkpointing=selective"])
    (root / "ep-launch.log").write_text(log)
    _launch(2, [*base, "run.name=pad", "train.max_steps=4", "model.moe.expert_parallel=2", "model.moe.exchange=padded",
                "train.activation_checkpointing=full", "train.parallel=fsdp"], checks=False)
    _launch(4, [*base, "run.name=mixed", "train.max_steps=3", "model.moe.expert_parallel=2", "train.parallel=fsdp",
                f"run.resume={root / 'one' / 'checkpoints' / 'step_00000002'}"], checks=False)
    _launch(2, [*base, "run.name=mixed", "train.max_steps=4", "model.moe.expert_parallel=2"], checks=False)
    _launch(2, [*base, "run.name=cut", "train.max_steps=4", "model.moe.expert_parallel=2",
                f"run.resume={root / 'one' / 'checkpoints' / 'step_00000002'}"], checks=False)
    return root


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _same_losses(want: list[dict], got: list[dict]) -> None:
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        a = [(e["step"], e[key]) for e in want if e["event"] == kind]
        b = [(e["step"], e[key]) for e in got if e["event"] == kind]
        assert [s for s, _ in a] == [s for s, _ in b] == ([1, 2, 3, 4] if kind == "train" else [2, 4])
        assert [v for _, v in b] == pytest.approx([v for _, v in a], abs=1e-5), kind


@pytest.mark.slow
@pytest.mark.parametrize("run,exchanges,strategies", [("ep", ["padded", "uneven"], ["ddp", "ddp"]),
                                                      ("pad", ["padded", "padded"], ["ddp", "fsdp"])])
def test_layouts_match_one_process_and_resume_on_fewer_processes_continues_exactly(runs, run, exchanges, strategies):
    """The model-level checks ran in the first launches (the fixture asserts their "ok"); here the runs they
    trained."""
    got = _events(runs / run)
    _same_losses(_events(runs / "one"), got)
    starts = [e for e in got if e["event"] == "start"]
    assert [(e["world"], e["resumed_from"].endswith("step_00000002")) for e in starts] == [(4, False), (2, True)]
    assert [e["layout"]["expert_exchange"] for e in starts] == exchanges   # the decision, recorded
    assert [e["layout"]["strategy"] for e in starts] == strategies
    assert max(e["moe.0.dropped_frac"] for e in got if e["event"] == "train") > 0, "the capacity must drop"
    assert json.loads((runs / run / "env.json").read_text())["layout"]["expert_exchange"] == exchanges[-1]
    if run == "pad":
        ckpt = runs / "pad" / "checkpoints" / "step_00000004"
        run_cli("export", str(ckpt), "--out", str(runs / "pad-export"))
        _same_weights(runs / "pad-export" / "model.safetensors",
                      runs / "one" / "checkpoints" / "step_00000004" / "model.safetensors")
        return
    # on 2 processes a rank takes 2 micro-batches of 2 a step: the log names the one micro-batch of 4 that fits
    log = (runs / "ep-launch.log").read_text()
    assert "expert parallelism: 2 micro-batches a step" in log and "train.micro_batch_size=4 fits" in log
    # the expert-parallel run's checkpoints are sharded (each rank wrote its experts); `trainbox export` reads the
    # whole model from them, equal to the single-process run's checkpoint
    ckpt = runs / "ep" / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "COMPLETE").read_text())["layout"] == "sharded"
    run_cli("export", str(ckpt), "--out", str(runs / "ep-export"))
    _same_weights(runs / "ep-export" / "model.safetensors",
                  runs / "one" / "checkpoints" / "step_00000004" / "model.safetensors")
    # the end-of-run sample runs on every rank (each forward needs the whole expert group): the same text
    last = [(runs / r / "samples.txt").read_text().split("--- step ")[-1] for r in ("ep", "one")]
    assert last[0].startswith("4\n") and last[0] == last[1]


@pytest.mark.slow
@pytest.mark.parametrize("run,layouts", [("mixed", [(4, "fsdp", 2), (2, "ddp", 2)]), ("cut", [(2, "ddp", 2)])])
def test_a_single_file_checkpoint_resumes_with_the_experts_split(runs, run, layouts):
    """One process's checkpoint (whole tensors in one file) cut to this rank's expert shards: under fsdp on 4
    processes, each expert shard on 2 of them, whose sharded checkpoint resumes on 2 processes under ddp; and under
    ddp on 2 processes. The same steps, the same final weights."""
    got = _events(runs / run)
    want = {e["step"]: e["loss"] for e in _events(runs / "one") if e["event"] == "train"}
    steps = {e["step"]: e["loss"] for e in got if e["event"] == "train"}
    assert sorted(steps) == [3, 4]
    assert [steps[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], abs=1e-5)
    starts = [e for e in got if e["event"] == "start"]
    assert [(e["world"], e["layout"]["strategy"], e["layout"]["expert_parallel"]) for e in starts] == layouts
    assert starts[0]["resumed_from"].endswith("one/checkpoints/step_00000002")
    if run == "mixed":
        assert starts[1]["resumed_from"].endswith("mixed/checkpoints/step_00000003")
    ckpt = runs / run / "checkpoints" / "step_00000004"
    run_cli("export", str(ckpt), "--out", str(runs / f"{run}-export"))
    _same_weights(runs / f"{run}-export" / "model.safetensors",
                  runs / "one" / "checkpoints" / "step_00000004" / "model.safetensors")


def _same_weights(got: Path, want: Path) -> None:
    final = [load_file(want), load_file(got)]
    assert final[0].keys() == final[1].keys()
    for k in final[0]:
        torch.testing.assert_close(final[1][k], final[0][k], **WEIGHT_TOL, msg=lambda m, k=k: f"{k}: {m}")


COMPILED = [("ddp", "none", "0"), ("fsdp", "none", "0.5"), ("ddp", "selective", "0.5"), ("fsdp", "experts", "0.5")]


@pytest.fixture(scope="module")
def compiled() -> subprocess.CompletedProcess:
    """One launch of tests/expert_compile_worker.py checking every configuration of COMPILED in turn: each worker's
    start (torch, Dynamo and Inductor imported and warmed) is paid once, not once per configuration."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(HERE / "expert_compile_worker.py"), *(",".join(c) for c in COMPILED)],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("parallel, checkpointing, capacity", COMPILED)
def test_compiled_expert_parallelism_can_read_its_split_sizes_inside_the_graph(compiled, parallel, checkpointing,
                                                                               capacity):
    """With the uneven exchange's split sizes in the compiled graph (model.moe.split_sizes: auto on a GPU the plan
    knows, or graph), and with them the experts' GELU and regrouping gathers as ATen's kernels (kernels/rows.py): no
    graph breaks at them, and the loss and gradients equal the uncompiled model's (tests/expert_compile_worker.py, 2
    processes, the trainer's build): dropless and dropping, under ddp, fsdp, and selective and experts activation
    checkpointing."""
    done = compiled.stdout.split()[1::2]   # rank 0's "ok CONFIG" lines, nothing else
    assert compiled.stdout.split()[::2] == ["ok"] * len(done), compiled.stdout[-3000:]
    assert f"{parallel},{checkpointing},{capacity}" in done, compiled.stdout[-3000:] + compiled.stderr[-6000:]
    # the launch ends cleanly (exit 0) once every configuration passed; a failed one ends it early
    assert compiled.returncode == 0 or len(done) < len(COMPILED), compiled.stderr[-6000:]


@pytest.mark.parametrize("overrides,world,says", [   # config/layout.py's rules (the one function every caller asks)
    (["model.moe.expert_parallel=3"], 3, "does not divide model.moe.num_experts=4"),
    (["model.moe.expert_parallel=2"], 3, "does not divide the run's 3 process(es)"),
    (["model.moe.expert_parallel=2"], 1, "does not divide the run's 1 process(es)"),
    (["model.moe.expert_parallel=2", "optim.name=muon"], 2, "runs with optim.name=adamw"),
    (["model.moe.expert_parallel=2", "model.family=gpt"], 2, "applies to model.family=moe"),
    (["model.moe.expert_parallel=2", "model.moe.exchange=padded", "model.moe.capacity_factor=0"], 2,
     "needs a capacity"),
])
def test_refused_settings_name_the_key(overrides, world, says):
    with pytest.raises(ConfigError, match=r"model\.moe\.") as e:   # a dense family: by the config itself
        decide_layout(load_config("tiny", [*MOE, *overrides]), world, adapt_micro_batch=True)
    assert says in str(e.value)
    for strategy in ("ddp", "fsdp"):   # the dense part either way
        ok = decide_layout(load_config("tiny", [*MOE, "model.moe.expert_parallel=2", f"train.parallel={strategy}"]), 4,
                           adapt_micro_batch=True)
        assert (ok.expert_parallel, ok.strategy, ok.micro_batch * ok.accumulation * ok.world) == (2, strategy, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
@pytest.mark.parametrize("n", [1, 4095, 4097, 3 * 4096 + 5])
def test_accumulate_kernel_equals_add(n):
    """kernels/accumulate.py (the expert gradients' fold into fp32 .grad): bit for bit torch's add_, tails included;
    a non-contiguous gradient takes add_ itself."""
    from trainbox.kernels.accumulate import accumulate_
    g = torch.Generator(device="cuda").manual_seed(n)
    acc = torch.randn(n, 2, device="cuda", generator=g)
    grad = torch.randn(n, 2, device="cuda", generator=g).to(torch.bfloat16)
    want = acc.clone().add_(grad)
    assert accumulate_(acc, grad) is acc and torch.equal(acc, want)
    strided = torch.randn(2, n, device="cuda", generator=g).to(torch.bfloat16).t()
    torch.testing.assert_close(accumulate_(acc, strided), want.add_(strided), rtol=0, atol=0)
