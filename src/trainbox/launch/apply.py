"""Run the commands that apply rendered files (docker compose, kubectl, sbatch, sky) or push images (docker, skopeo)
when the tool exists."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from trainbox.errors import TrainboxError

INSTALL = {
    "docker": "install Docker Engine with the compose plugin: https://docs.docker.com/engine/install/",
    "kubectl": "install kubectl and point it at the cluster: https://kubernetes.io/docs/tasks/tools/",
    "sbatch": "run this on a Slurm login node (sbatch is part of Slurm)",
    "skopeo": "install skopeo (apt-get install skopeo, brew install skopeo): https://github.com/containers/skopeo",
    "sky": "install SkyPilot with your clouds' extras and run `sky check`: pip install 'skypilot[aws,gcp,kubernetes]'",
    "mkdir": "a POSIX shell environment",
}


class ToolMissing(TrainboxError):
    """The program that applies the files is not installed here."""


def missing_tool(cmd: list[str]) -> str | None:
    """The program (or docker plugin) `cmd` needs that is missing, or None."""
    if shutil.which(cmd[0]) is None:
        return cmd[0]
    if cmd[0] == "docker" and len(cmd) > 1 and cmd[1] in ("compose", "buildx"):
        probe = subprocess.run(["docker", cmd[1], "version"], capture_output=True, text=True)
        if probe.returncode != 0:
            return f"docker {cmd[1]}"
    return None


def check_tools(commands: list[list[str]]) -> None:
    for cmd in commands:
        tool = missing_tool(cmd)
        if tool:
            raise ToolMissing(f"'{tool}' is not installed here, so `{' '.join(cmd)}` cannot run",
                              hint=INSTALL[tool.split()[0]])


def run_commands(commands: list[list[str]], cwd: Path) -> int:
    """Run each command in `cwd`, stopping at the first failure; returns its exit code."""
    check_tools(commands)
    for cmd in commands:
        rc = subprocess.run(cmd, cwd=cwd).returncode
        if rc != 0:
            return rc
    return 0
