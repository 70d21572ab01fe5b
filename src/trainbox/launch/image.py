"""`trainbox launch image`: the docker buildx command (and push) for the CUDA or ROCm image.

Tags spell the stack: <registry>/trainbox:<version>-cu<cuda>-torch<torch> (CUDA) or
<registry>/trainbox:<version>-rocm<rocm>-torch<torch> (ROCm); the versions are the Dockerfiles' build
arguments, read from the Dockerfile itself so the defaults live in one place.
"""
from __future__ import annotations

import re
from pathlib import Path

from trainbox.errors import ConfigError


def dockerfile_args(dockerfile: Path) -> dict[str, str]:
    """ARG NAME=default pairs of a Dockerfile (the first default of each name)."""
    if not dockerfile.is_file():
        raise ConfigError(f"{dockerfile} not found", hint="run from the trainbox repository root, or pass --context")
    out: dict[str, str] = {}
    for m in re.finditer(r"^ARG\s+(\w+)=(\S+)", dockerfile.read_text(), flags=re.M):
        out.setdefault(m.group(1), m.group(2))
    return out


def image_tag(version: str, args: dict[str, str], rocm: bool) -> str:
    if rocm:
        return f"trainbox:{version}-rocm{args['ROCM_VERSION']}-torch{args['TORCH_VERSION']}"
    return f"trainbox:{version}-{args['TORCH_CUDA']}-torch{args['TORCH_VERSION']}"


def build_commands(context: Path, registry: str | None, tag: str | None, rocm: bool = False, push: bool = False,
                   build_args: list[str] = (), platform: str = "linux/amd64") -> list[list[str]]:
    """The docker buildx command: one build, tagged with the stack tag and `tag`, pushed with --push."""
    if push and not registry:
        raise ConfigError("--push needs --registry (where to push)", hint="e.g. --registry ghcr.io/ORG")
    dockerfile = context / "docker" / ("Dockerfile.rocm" if rocm else "Dockerfile")
    args = dockerfile_args(dockerfile)
    overridden: list[str] = []
    for item in build_args:
        if "=" not in item:
            raise ConfigError(f"--build-arg '{item}' is not NAME=VALUE")
        k, v = item.split("=", 1)
        if k not in args:
            raise ConfigError(f"--build-arg {k}: {dockerfile.name} has no such ARG", hint=f"ARGs: {', '.join(args)}")
        args[k] = v
        overridden += ["--build-arg", f"{k}={v}"]
    version = args["TRAINBOX_VERSION"]
    prefix = f"{registry.rstrip('/')}/" if registry else ""
    tags = [prefix + image_tag(version, args, rocm)]
    if tag:
        tags.append(f"{prefix}trainbox:{tag}")
    cmd = ["docker", "buildx", "build", "--file", str(dockerfile.relative_to(context)), "--platform", platform,
           *overridden]
    for t in tags:
        cmd += ["--tag", t]
    cmd += ["--push" if push else "--load", "."]
    return [cmd]
