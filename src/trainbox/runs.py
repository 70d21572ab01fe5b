"""Run directories: create, describe (env.json), list and check (like `docker ps` for training runs)."""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device | None = None, world: int = 1) -> dict:
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}"})
    import trainbox
    return {
        "trainbox": trainbox.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "rocm": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpus": gpus, "device": str(device) if device else None, "world_size": world,
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "git_commit": _git_commit(), "command": sys.argv if not hasattr(sys, "ps1") else [],
    }


def write_env(run_dir: Path, argv: list[str], device: torch.device, world: int) -> None:
    env = environment(device, world)
    if argv:
        env["command"] = argv
    tmp = run_dir / ".env.json.tmp"
    tmp.write_text(json.dumps(env, indent=1))
    os.replace(tmp, run_dir / "env.json")
