"""Validation loss after a fixed training time, ours and modded-nanogpt's record script, as JSON lines and a record.

    python benchmarks/time_to_loss.py speedrun-124m --data /tmp/corpus/modded/pyc --steps 295 [key=value ...]
    python benchmarks/time_to_loss.py speedrun-124m --data /tmp/corpus/modded/pyc --steps 0 \
        --peer .peers/sub3min.py --peer-steps 310

Both sides are timed by modded-nanogpt's rule: training time is the wall time of steps 11..N (the first
ten steps, compilation among them, and every evaluation are left out), and the loss is the closing
validation loss over the first 10,485,760 validation tokens in packed windows with document-causal
attention. Choose the step counts so that both train for the time you compare at: the schedules
(learning-rate cooldown, window warm-up) are laid out over the step count, so a run cut short by a clock
would not be the recipe.

Ours runs the real loop (`trainbox train`'s Trainer) with monitor.log_every=10; every logged window
ends in a host sync, so the metrics.jsonl timestamps of steps 10 and N bound the timed steps. The speedrun
recipes warm their window up over the whole run (window_warmup_steps null), as the record scripts do.

The peer is a record script (code present locally, never committed) run as
`torchrun --standalone --nproc_per_node 1 SCRIPT`, with its data and length passed through the
environment: PEER_TRAIN and PEER_VAL (glob patterns relative to the data folder, which is its working
directory), PEER_STEPS and PEER_VAL_EVERY=0. The script must read them (a local patch of the record
script does); its closing "step:N/N val_loss:... train_time:...ms" line is parsed. Runs of both sides
rarely fit one 10-minute device call; pass --steps 0 or --peer-steps 0 to run one side. The last output is the
result record (common.Result, the peer as its baseline); --record also writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import common

TIMED_FROM = 10   # modded-nanogpt's scripts reset their clock at the end of step 10


def run_ours(recipe: str, data: str, steps: int, overrides: list[str]) -> dict:
    import torch

    from trainbox.config import load_config
    from trainbox.train.loop import Trainer

    if steps <= TIMED_FROM or steps % 10:
        raise SystemExit(f"--steps must be a multiple of 10 above {TIMED_FROM} "
                         "(the logged windows bound the timed steps)")
    tmp = tempfile.mkdtemp(prefix="ttl-")
    cfg = load_config(recipe, [f"data.path={data}", f"train.max_steps={steps}", "monitor.log_every=10",
                               "train.eval_every=0", "train.checkpoint_every=0", "train.sample_tokens=0",
                               f"run.dir={tmp}", "monitor.port=0", *overrides])
    summary = Trainer(cfg).run()
    events = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {e["step"]: e["time"] for e in events if e["event"] == "train" and "tokens_per_s" in e}
    train_s = logged[steps] - logged[TIMED_FROM]
    return {"who": "trainbox", "recipe": recipe, "overrides": overrides, "steps": steps,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "commit": common.git_state()[0],
            "tokens": steps * cfg.train.global_batch_size * cfg.data.seq_len,
            "train_time_s": round(train_s, 2), "step_avg_ms": round(1e3 * train_s / (steps - TIMED_FROM), 2),
            "val_loss": summary.get("val_loss"), "val_tokens": summary.get("val_tokens"),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}


def parse_peer_log(text: str) -> dict:
    """The closing validation line of a modded-nanogpt record script's output."""
    matches = list(re.finditer(r"step:(\d+)/(\d+) val_loss:([\d.]+) train_time:(\d+)ms step_avg:([\d.]+)ms", text))
    m = matches[-1] if matches else None
    if m is None or m.group(1) != m.group(2):
        raise ValueError("no closing 'step:N/N val_loss:...' line in the peer's output")
    return {"steps": int(m.group(1)), "val_loss": float(m.group(3)), "train_time_s": int(m.group(4)) / 1e3,
            "step_avg_ms": float(m.group(5))}


def run_peer(script: str, data: str, steps: int) -> dict:
    prefix = Path(data).resolve()
    env = {**os.environ, "PEER_TRAIN": f"{prefix.name}_train_*.bin", "PEER_VAL": f"{prefix.name}_val_*.bin",
           "PEER_STEPS": str(steps), "PEER_VAL_EVERY": "0"}
    t0 = time.time()
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "1", str(Path(script).resolve())],
                          cwd=prefix.parent, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    try:
        res = parse_peer_log(out)
    except ValueError as e:
        return {"who": "peer", "script": script, "error": f"{e}; rc {proc.returncode}", "tail": out[-3000:]}
    return {"who": "peer", "script": script, **res, "wall_s": round(time.time() - t0, 1),
            "env": {k: env[k] for k in sorted(env) if k.startswith("PEER_")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--data", required=True, help="token-file prefix (data.path; the peer reads PREFIX_train_*.bin)")
    ap.add_argument("--steps", type=int, required=True, help="our optimizer steps (0: skip ours)")
    ap.add_argument("--peer", help="a modded-nanogpt record script that reads PEER_* from the environment")
    ap.add_argument("--peer-steps", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-time-to-loss, or peer-time-to-loss)")
    args = ap.parse_intermixed_args()
    peer = ours = None
    if args.peer and args.peer_steps:   # first, while this process holds no GPU memory
        peer = run_peer(args.peer, args.data, args.peer_steps)
        print(json.dumps(peer), flush=True)
    if args.steps:
        ours = run_ours(args.recipe, args.data, args.steps, args.overrides)
        print(json.dumps(ours), flush=True)
    if ours is None and peer is None:
        return
    skip = ("who", "recipe", "gpu", "torch", "commit", "overrides")
    peer_command = f"torchrun --standalone --nproc_per_node 1 {args.peer}"
    common.emit(common.Result(
        tool="time_to_loss", what=args.what or (f"{args.recipe}-time-to-loss" if ours else "peer-time-to-loss"),
        gpu=common.gpu_info(), software=common.software(), recipe=args.recipe if ours else None,
        overrides=args.overrides if ours else [],
        metrics={k: v for k, v in (ours or peer).items() if k not in skip},
        baseline={"name": f"record script {Path(args.peer).name}", "command": peer_command, "metrics": peer}
        if ours and peer else None), args.record)


if __name__ == "__main__":
    main()
