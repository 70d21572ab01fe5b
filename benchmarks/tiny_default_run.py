"""The README's first command, `trainbox train` (recipe tiny, CPU), timed end to end against another commit's.

    python benchmarks/tiny_default_run.py --old 0695b57 --repeat 2 --record

Each run starts in a fresh temporary folder that is also its HOME, so the embedded corpus is tokenized anew
(the first run a user makes): `/usr/bin/time` around `python -m trainbox train` with PYTHONPATH set to this
tree's `src/`, or to a git worktree of --old made for the call. Runs alternate, old first, so load from
other work on the machine falls on both alike; the fastest of each side is reported, with every run's wall
time, CPU time and the load average beside it. The closing validation bits per byte is the run's own line.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import common

COMMAND = "cd $(mktemp -d) && HOME=$PWD /usr/bin/time -f '%e s, %M KB' trainbox train"


def run_once(src: Path, overrides: list[str]) -> dict:
    """One `trainbox train` from `src` in a fresh folder -> wall, CPU seconds, peak RSS, validation figures."""
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "HOME": home, "PYTHONPATH": str(src)}
        cmd = ["/usr/bin/time", "-f", "TIME %e %U %S %M", sys.executable, "-m", "trainbox", "train", *overrides]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"trainbox train from {src} exited {proc.returncode}:\n{out[-3000:]}")
    wall, user, system, rss = re.findall(r"^TIME (\S+) (\S+) (\S+) (\d+)$", out, re.M)[-1]
    loss, bpb = re.findall(r"validation: ([\d.]+) nats/token, ([\d.]+) bits/byte", out)[-1]
    return {"wall_s": float(wall), "cpu_s": round(float(user) + float(system), 1), "max_rss_mib": int(rss) // 1024,
            "val_bits_per_byte": float(bpb), "val_loss_nats_per_token": float(loss),
            "load_average_1min_at_start": round(load, 2)}


def summary(runs: list[dict]) -> dict:
    best = min(runs, key=lambda r: r["wall_s"])
    return {**{k: best[k] for k in ("wall_s", "val_bits_per_byte", "val_loss_nats_per_token", "max_rss_mib")},
            "cpu_s": best["cpu_s"], "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the commit to time against (a git worktree is made for it)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each side, alternating; the fastest is reported")
    ap.add_argument("--notes", default="", help="what the record should say about the machine and its load")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("overrides", nargs="*", help="key=value settings for both sides (none: the README's command)")
    args = ap.parse_args()
    old_commit = subprocess.run(["git", "rev-parse", args.old], cwd=common.REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), old_commit], cwd=common.REPO,
                       check=True, capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for i in range(args.repeat):
                for side, src in (("old", worktree / "src"), ("new", common.REPO / "src")):
                    runs[side].append(run_once(src, args.overrides))
                    print(f"{side} {i + 1}: {runs[side][-1]}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=common.REPO, check=False)
    new, old = summary(runs["new"]), summary(runs["old"])
    metrics = {**new, "ratio_old_vs_new_wall": round(old["wall_s"] / new["wall_s"], 3), "cpu_count": os.cpu_count()}
    common.emit(common.Result(
        tool="tiny_default_run", what="tiny-default-run", recipe="tiny", overrides=args.overrides, notes=args.notes,
        baseline={"name": f"the same command at {old_commit[:7]}, runs alternating with these", "command": COMMAND,
                  "metrics": old},
        metrics=metrics), args.record)


if __name__ == "__main__":
    main()
