"""Two nodes on one host: `trainbox train --nproc 2 --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT`, started
twice, forms one job of 4 processes (torchrun, c10d rendezvous, gloo). The command is the one `trainbox launch k8s
--api trainer` renders for its nodes, with the values the Trainer gives its PET_* variables. With
train.parallel=fsdp it builds the HSDP mesh (replicate 2 x shard 2: sharded inside a node, replicated across), and
every step's loss and gradient norm equal one process's within 1e-5 in fp32 (the same maths; only the order of
floating-point sums differs). Its sharded checkpoint resumes on one process and on one node of 4 processes, each
continuing as one process would. The rendered Slurm `srun` line and SkyPilot `run` script, run by bash as two nodes,
equal one process too. Also: the launcher's node flags refused in one line when they do not fit together.
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import yaml
from conftest import TINY, run_cli
from nodes import Node, finish, losses, start_nodes

from trainbox.config import load_config
from trainbox.launch import LaunchSpec, render
from trainbox.rundir import ranks
from trainbox.train.loop import train

OWN = [o for o in TINY if not o.startswith("monitor.")]
STEPS = ["train.max_steps=9", "train.checkpoint_every=3", "train.keep_last=3", "train.dtype=fp32",
         "monitor.enabled=false", "train.micro_batch_size=2", "train.eval_tokens=512", "train.sample_tokens=0"]


def _same(got: dict, ref: dict, steps) -> None:
    for s in steps:
        assert got[s][0] == pytest.approx(ref[s][0], abs=1e-5), (s, got[s], ref[s])
        assert got[s][1] == pytest.approx(ref[s][1], abs=1e-5), (s, got[s], ref[s])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """The single-process run every multi-node job is compared with (ROOT/ref), and the overrides it ran with:
    (ROOT, overrides)."""
    root = tmp_path_factory.mktemp("multinode")
    base = [*OWN, *STEPS, f"run.dir={root}", f"data.cache_dir={data_cache}"]
    train(load_config("tiny", [*base, "run.name=ref"]))   # one process, accumulation 4
    return root, base


@pytest.fixture(scope="module")
def runs(reference):
    root, base = reference
    # the command `trainbox launch k8s --api trainer` renders for each node, run as the Trainer would run it
    spec = LaunchSpec(target="k8s", api="trainer", recipe="tiny", overrides=[*base, "run.name=two",
                      "train.parallel=fsdp"], image="reg/trainbox:t", nodes=2, gpus_per_node=2)
    pod = yaml.safe_load(render(spec).files["runtime.yaml"])["spec"]["template"]["spec"]["replicatedJobs"][0]
    [container] = pod["template"]["spec"]["template"]["spec"]["containers"]
    outs = finish(start_nodes([], root, "two", rendered=container["args"], nproc=2))
    ckpts = root / "two" / "checkpoints"
    train(load_config("tiny", [*base, "run.name=one", f"run.resume={ckpts / 'step_00000006'}",
                               "train.parallel=fsdp"]))
    run_cli("train", "tiny", "--nproc", "4", *base, "run.name=four", "train.parallel=fsdp",
            f"run.resume={ckpts / 'step_00000003'}")
    return root, outs, base


@pytest.mark.slow
def test_two_nodes_build_hsdp_and_equal_one_process(runs):
    root, outs, _ = runs
    ref = losses(root / "ref")
    _same(losses(root / "two"), ref, range(1, 10))
    start = next(json.loads(x) for x in (root / "two" / "metrics.jsonl").read_text().splitlines()
                 if '"start"' in x)
    assert start["world"] == 4 and start["parallel"] == "fsdp"
    assert start["mesh"] == {"replicate": 2, "shard": 2}
    assert "fsdp mesh: replicate 2 x shard 2 (2 node(s) of 2)" in (root / "two" / "train.log").read_text()
    # each launcher's node as its ranks recorded it: ranks 0-1 on one, 2-3 on the other, all ended by themselves
    nodes = {b.rank: b.node for b in ranks.read(root / "two")}
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3] and {nodes[0], nodes[2]} == {0, 1}, nodes
    assert {b.ended for b in ranks.read(root / "two")} == {"finished"}


@pytest.mark.slow
def test_a_two_node_checkpoint_resumes_on_one_process_and_on_four(runs):
    root, _, _ = runs
    ref = losses(root / "ref")
    _same(losses(root / "one"), ref, range(7, 10))      # 2 nodes x 2 -> 1 process
    _same(losses(root / "four"), ref, range(4, 10))     # 2 nodes x 2 -> 1 node x 4


@pytest.mark.slow
def test_the_rendered_slurm_lines_run_as_two_nodes(reference, tmp_path):
    """The sbatch script's own TRAIN array and srun line, run by bash on this host as Slurm would run them on two
    nodes (srun's options dropped, SLURM_NODEID, the head node and its port set; `trainbox` this checkout): one
    job whose steps equal one process's."""
    root, base = reference
    spec = LaunchSpec(target="slurm", recipe="tiny", overrides=[*base, "run.name=slurm"], nodes=2, gpus_per_node=1,
                      project_dir=tmp_path)
    [script] = render(spec).files.values()
    train = re.search(r"^TRAIN=\(\n.*?^\)\n", script, re.S | re.M).group(0)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    step = re.sub(r"^srun( --\S+)* ", "", srun).replace(" || rc=$?", "")
    assert step.startswith("bash -c"), srun
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "trainbox").write_text(f"#!/bin/sh\nexec {sys.executable} -m trainbox \"$@\"\n")
    (shim / "trainbox").chmod(0o755)

    def node(rank: int, port: int, log) -> Node:
        lines = f"HEAD_NODE=127.0.0.1\nRDZV_PORT={port}\nSLURM_JOB_ID=4242\n{train}exec {step}\n"
        return Node([], log, cmd=["bash", "-c", lines], env={"SLURM_NODEID": str(rank),
                                                              "PATH": f"{shim}:{os.environ['PATH']}"})
    outs = finish(start_nodes([], tmp_path, "slurm", make=node))
    assert any("launching:" in o and "--rdzv-id=4242" in o for o in outs), outs
    _same(losses(root / "slurm"), losses(root / "ref"), range(1, 10))


@pytest.mark.slow
def test_the_rendered_skypilot_run_script_runs_as_two_nodes(reference, tmp_path):
    """task.yaml's `run` script from `trainbox launch sky --nodes 2 --gpus H100:1`, run by bash on this host as
    SkyPilot runs it on each node: its variables set as SkyPilot sets them (both nodes' IPs this host's, so node 0
    hosts the rendezvous), the task's envs with the values `sky launch --env` would give (run.dir: the test's folder,
    the rendezvous port: a free one); `trainbox` this checkout. One job of two nodes whose steps equal one
    process's."""
    root, base = reference
    own = [o for o in base if not o.startswith("run.dir=")]
    spec = LaunchSpec(target="sky", recipe="tiny", overrides=[*own, "run.name=sky"], nodes=2, gpus="H100:1")
    task = yaml.safe_load(render(spec).files["task.yaml"])
    assert set(task["envs"]) == {"TRAINBOX_RUNS", "TRAINBOX_RDZV_PORT", "TRAINBOX_INSTALL"}
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "trainbox").write_text(f"#!/bin/sh\nexec {sys.executable} -m trainbox \"$@\"\n")
    (shim / "trainbox").chmod(0o755)

    def node(rank: int, port: int, log) -> Node:
        sky = {"SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n", "SKYPILOT_NUM_NODES": "2",
               "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_GPUS_PER_NODE": "1"}
        return Node([], log, cmd=["bash", "-c", task["run"]],
                    env={**sky, "TRAINBOX_RUNS": str(root), "TRAINBOX_RDZV_PORT": str(port),
                         "PATH": f"{shim}:{os.environ['PATH']}"})
    outs = finish(start_nodes([], tmp_path, "sky", make=node))
    assert any("launching:" in o and "--nnodes=2" in o for o in outs), outs
    start = next(json.loads(x) for x in (root / "sky" / "metrics.jsonl").read_text().splitlines() if '"start"' in x)
    assert start["world"] == 2
    assert {b.node for b in ranks.read(root / "sky")} == {0, 1}
    _same(losses(root / "sky"), losses(root / "ref"), range(1, 10))


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2 is not a node of --nnodes 2"),
    (["--rdzv-endpoint", "h:1"], "are for a job of several nodes"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "needs --rdzv-endpoint HOST:PORT"),
])
def test_node_flags_that_do_not_fit_are_refused(tmp_path, flags, message):
    out = run_cli("train", "tiny", *flags, f"run.dir={tmp_path}", check=False)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
