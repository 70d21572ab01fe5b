"""Two "nodes" on one machine against one node with all its GPUs: HSDP across nodes against plain FSDP, same call.

    python benchmarks/nodes_check.py llama-1b --data /tmp/corpus/modded/pyc --nodes 2 --nproc 2 --steps 30 \
        train.parallel=fsdp --record

Runs RECIPE twice with the same global batch and seed: first `trainbox train --nproc NODES*NPROC` (one node, fsdp
shards over every GPU: the baseline), then NODES launchers `trainbox train --nproc NPROC --nnodes NODES --node-rank R
--rdzv-endpoint 127.0.0.1:PORT`, each on its own GPUs (CUDA_VISIBLE_DEVICES), as a multi-node job is started
(fsdp builds the HSDP mesh: replicate NODES x shard NPROC). Prints one JSON object: each run's mesh, median
tokens/s of its logged windows after --warmup steps, and both loss curves with their largest difference. On one
machine the "nodes" share NVLink, so the figure is the cost of the HSDP layout itself (an all-reduce of the
gradient shards across replicas), not of a network between machines. On a CPU (gloo) it runs too (`tiny`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.endswith("}")]


def summary(run_dir: Path, warmup: int) -> dict:
    ev = events(run_dir)
    train = [e for e in ev if e["event"] == "train"]
    speeds = [e["tokens_per_s"] for e in train if e.get("tokens_per_s") and e["step"] > warmup]
    start = next(e for e in ev if e["event"] == "start")
    return {"mesh": start.get("mesh"), "world": start.get("world"),
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "losses": {e["step"]: e["loss"] for e in train}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nodes_job(recipe: str, nodes: int, nproc: int, args: list[str]) -> None:
    """NODES launchers on this machine, each on its own GPUs; node 0 first, the others once it listens."""
    port = free_port()
    procs = []
    for r in range(nodes):
        env = dict(os.environ)
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(r * nproc + i) for i in range(nproc))
        procs.append(subprocess.Popen([sys.executable, "-m", "trainbox", "train", "--nproc", str(nproc), "--nnodes",
                                       str(nodes), "--node-rank", str(r), "--rdzv-endpoint", f"127.0.0.1:{port}",
                                       recipe, *args], env=env))
        while r == 0:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if procs[0].poll() is not None:
                    raise SystemExit(f"node 0 ended ({procs[0].returncode}) before it hosted the rendezvous") from None
                time.sleep(0.1)
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"the {nodes}-node job failed: exit codes {codes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--data", help="token-file prefix for data.path (default: the recipe's)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per node")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-NODESxNPROC-hsdp-vs-fsdp)")
    args = ap.parse_intermixed_args()
    root = Path(tempfile.mkdtemp(prefix="nodes-check-"))
    try:
        base = [*([f"data.path={args.data}"] if args.data else []), f"train.max_steps={args.steps}",
                "monitor.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.checkpoints=false",
                "monitor.port=0", f"run.dir={root}", *args.overrides]
        subprocess.run([sys.executable, "-m", "trainbox", "train", "--nproc", str(args.nodes * args.nproc),
                        args.recipe, *base, "run.name=one-node"], check=True)
        nodes_job(args.recipe, args.nodes, args.nproc, [*base, "run.name=nodes"])
        one, many = summary(root / "one-node", args.warmup), summary(root / "nodes", args.warmup)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    steps = sorted(set(one["losses"]) & set(many["losses"]))
    result = {"nodes": args.nodes, "nproc_per_node": args.nproc, "steps": args.steps, "mesh": many["mesh"],
              "tokens_per_s": many["tokens_per_s"],
              "max_abs_loss_diff": max(abs(one["losses"][s] - many["losses"][s]) for s in steps),
              "losses": [round(many["losses"][s], 5) for s in steps]}
    baseline = {"mesh": one["mesh"], "tokens_per_s": one["tokens_per_s"],
                "losses": [round(one["losses"][s], 5) for s in steps]}
    print(json.dumps({**result, "one_node": baseline}), flush=True)
    common.emit(common.Result(
        tool="nodes_check", what=args.what or f"{args.recipe}-{args.nodes}x{args.nproc}-hsdp-vs-fsdp",
        gpu=common.gpu_info(), software=common.software(), recipe=args.recipe, overrides=args.overrides,
        metrics=result, baseline={"name": f"1 node x {args.nodes * args.nproc}", "command": None,
                                  "metrics": baseline}), args.record)


if __name__ == "__main__":
    main()
