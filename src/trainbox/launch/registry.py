"""Container registries: the names `launch image --registry` pushes to, the region -> registry file
(`--registries FILE`), and the image a cluster in one region pulls (`launch k8s/sky --region R --registries FILE`).

The file is YAML or JSON, one region per key, its registry as the value:

    us-east-1: 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml
    europe-west4: europe-west4-docker.pkg.dev/my-project/ml

A registry is a reference without a tag, as Docker spells it: an optional host (with a dot or a port, or
`localhost`) and lower-case path components (`ghcr.io/org`, `registry:5000/team`, `myuser` on Docker Hub).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from trainbox.errors import ConfigError

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
# a host has a dot or a port, or is localhost (Docker reads a first part without one as a Docker Hub namespace)
_HOST = rf"(?:localhost(?::[0-9]+)?|{_LABEL}(?:\.{_LABEL})+(?::[0-9]+)?|{_LABEL}:[0-9]+)"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REGISTRY = re.compile(rf"^(?:{_HOST}/)?{_PATH}(?:/{_PATH})*$|^{_HOST}$")
EXAMPLE = "e.g. ghcr.io/my-org or 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml"


def check_registry(name: str, where: str = "--registry") -> str:
    """`name` without a trailing slash, or a ConfigError saying what is wrong with it."""
    value = name.strip().rstrip("/")
    if not REGISTRY.match(value):
        why = ("drop the scheme" if "://" in value else "drop the tag: the stack tag and --tag are added"
               if re.search(r"/[^/]*:", value) else "path parts are lower-case letters, digits and . _ -")
        raise ConfigError(f"{where}: '{name}' is not a registry name ({why})", hint=EXAMPLE)
    return value


def load_registries(path: str | Path) -> dict[str, str]:
    """The region -> registry mapping of a YAML or JSON file, each registry checked."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--registries {path}: no such file",
                          hint=f"write one line per region, e.g. 'us-east-1: {EXAMPLE.split()[1]}'")
    try:
        data = (json.loads if path.suffix == ".json" else yaml.safe_load)(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--registries {path}: not YAML or JSON ({str(e).splitlines()[0]})") from None
    if data is None or data == {}:
        raise ConfigError(f"--registries {path} names no registries",
                          hint="write one line per region: REGION: REGISTRY")
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(f"--registries {path}: expected a mapping of region -> registry name",
                          hint="write one line per region: REGION: REGISTRY")
    return {str(region): check_registry(reg, f"--registries {path}, region {region}") for region, reg in data.items()}


def registries_to_push(registries: list[str], registries_file: str | None) -> list[str]:
    """Every registry named by --registry and --registries FILE, checked, each once, in the order given."""
    named = [check_registry(r) for r in registries]
    if registries_file:
        named += load_registries(registries_file).values()
    return list(dict.fromkeys(named))


def regional_image(image: str | None, registries_file: str | None, region: str | None) -> str | None:
    """The image a cluster in `region` pulls: `--image NAME:TAG` under the registry the file names for the region.
    Without --registries the image is used as given."""
    if not registries_file:
        return image
    registries = load_registries(registries_file)
    if not region:
        raise ConfigError(f"--registries {registries_file} needs --region (the cluster's region) to pick one of "
                          f"{', '.join(registries)}")
    if region not in registries:
        raise ConfigError(f"--region {region}: {registries_file} names no registry for it",
                          hint=f"regions there: {', '.join(registries)}; add a line '{region}: REGISTRY'")
    if not image or "/" in image or ":" not in image:
        raise ConfigError(f"--image {image or '(none)'}: with --registries give the image's name and tag only "
                          "(e.g. trainbox:latest); the registry comes from the file",
                          hint="push it to every region with: trainbox launch image --push --registries "
                               f"{registries_file} --tag TAG")
    return f"{registries[region]}/{image}"
