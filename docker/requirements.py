"""Print trainbox's pip requirements from pyproject.toml, so an image installs them before the code.

Used by docker/Dockerfile and docker/Dockerfile.rocm (dependencies form their own layer; editing code
reuses it). Runs on the image's Python with the standard library only:

    python docker/requirements.py pyproject.toml --extras hf,tracking --exclude torch > requirements.txt
    python docker/requirements.py pyproject.toml --pin-installed torch > constraints.txt

`--exclude torch` leaves torch to the image (a CUDA wheel, or the ROCm base image's own build);
`--pin-installed torch` writes `torch==<installed version>` as a pip constraint so no other package
can replace that torch.
"""
from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata


def _load_toml(path: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10 base images
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(pyproject: dict, extras: list[str], exclude: set[str]) -> list[str]:
    """Core dependencies plus those of each extra, without duplicates and without excluded names."""
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml defines {', '.join(optional)}")
    out: list[str] = []
    for req in [*project.get("dependencies", []), *(r for e in extras for r in optional[e])]:
        if _name(req) not in exclude and req not in out:
            out.append(req)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pyproject")
    p.add_argument("--extras", default="", help="comma-separated extras, e.g. hf,tracking")
    p.add_argument("--exclude", default="", help="comma-separated package names to leave out")
    p.add_argument("--pin-installed", default="", help="print name==installed-version for these packages")
    args = p.parse_args(argv)
    if args.pin_installed:
        for name in filter(None, args.pin_installed.split(",")):
            print(f"{name}=={metadata.version(name)}")
        return 0
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    exclude = {_name(e) for e in args.exclude.split(",") if e.strip()}
    print("\n".join(requirements(_load_toml(args.pyproject), extras, exclude)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
