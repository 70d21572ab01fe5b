"""`trainbox launch image`: the docker buildx command (and push) for the CUDA or ROCm image.

Tags spell the stack: <registry>/trainbox:<version>-cu<cuda>-torch<torch> (CUDA) or
<registry>/trainbox:<version>-rocm<rocm>-torch<torch> (ROCm); the versions are the Dockerfiles' build
arguments, read from the Dockerfile itself so the defaults live in one place.

One image, every region: with several registries (`--registry R1 --registry R2`, or `--registries FILE`, a
region -> registry mapping) `--push` builds ONCE into an OCI archive (build/trainbox-STACK.oci.tar) and copies that
one archive to every registry and tag with `skopeo copy --all --preserve-digests`. Every push has the same source,
a file nothing changes between pushes, and --preserve-digests makes skopeo refuse any copy that would rewrite the
manifest, so every registry serves the same bytes under the same digest. (A buildx `--push` to many tags pushes one
build too, but then the copy that fails midway or a re-run rebuilds; separate `docker push`es after a `docker
tag` let the daemon re-encode layers and manifests, which can change the digest.) One registry keeps the plain
`docker buildx build --push`. The OCI exporter needs a BuildKit builder that can export it (the docker-container
driver, or Docker's containerd image store): `docker buildx create --use --driver docker-container` once.
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


def build_commands(context: Path, registries: list[str], tag: str | None, rocm: bool = False, push: bool = False,
                   build_args: list[str] = (), platform: str = "linux/amd64") -> list[list[str]]:
    """The commands that build the image once, tagged with the stack tag and `tag` under each registry; with
    `push`, pushed to one registry by buildx, or to several from one OCI archive (module docstring)."""
    if push and not registries:
        raise ConfigError("--push needs --registry (where to push) or --registries FILE",
                          hint="e.g. --registry ghcr.io/ORG (repeat it for every region's registry)")
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
    stack = image_tag(args["TRAINBOX_VERSION"], args, rocm)
    names = [stack, *([f"trainbox:{tag}"] if tag else [])]
    refs = [f"{prefix}{n}" for prefix in ([f"{r}/" for r in registries] or [""]) for n in names]
    cmd = ["docker", "buildx", "build", "--file", str(dockerfile.relative_to(context)), "--platform", platform,
           *overridden]
    if not push or len(registries) == 1:
        for t in refs:
            cmd += ["--tag", t]
        return [cmd + ["--push" if push else "--load", "."]]
    archive = f"build/{stack.replace(':', '-')}.oci.tar"
    copies = [["skopeo", "copy", "--all", "--preserve-digests", f"oci-archive:{archive}", f"docker://{ref}"]
              for ref in refs]
    return [["mkdir", "-p", "build"], cmd + ["--output", f"type=oci,dest={archive}", "."], *copies]
